"""Held-out evaluation: greedy accuracy and pass@k of a policy on task problems.

Owns the evaluation a run does before and after RL (``greedy_answers``,
``answer_accuracy``) and the stand-alone one behind ``areal-flow eval``
(``evaluate_model``: a model spec + a task name -> a JSON-able result). Must not train or
change the model.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from areal_flow.ops.generate import encode_prompt
from runtime.engines.generation import GenerationEngine, GenerationRequest, SamplingParams


def greedy_answers(
    engine_or_model, tokenizer, task, problems: list[dict], max_batch_size: int = 128, chat_template: bool | None = None
) -> list[str]:
    """The greedy (temperature 0) completion text of every problem, in order, special
    tokens removed (so the text up to EOS is the whole text when generation stopped).

    Args:
        engine_or_model: an idle ``GenerationEngine``, or a causal LM (wrapped in a
            fresh engine of ``max_batch_size`` rows; the model is put in eval mode).
        tokenizer: encodes prompts (``ops.generate.encode_prompt``) and supplies EOS.
        task: its ``max_answer_tokens`` bounds the completion (16 new tokens when absent).
        problems: dicts with ``"prompt"``.
        chat_template: as ``ops.generate(chat_template=...)``; None = when the tokenizer
            has a chat template (what the rollout worker does by default).

    Raises:
        RuntimeError: the engine has requests in flight.
        ValueError: ``chat_template=True`` and the tokenizer has none.
    """
    if not problems:
        return []
    engine = engine_or_model
    if not isinstance(engine, GenerationEngine):
        engine = GenerationEngine(engine_or_model, tokenizer, max_batch_size=max_batch_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=getattr(task, "max_answer_tokens", 16))
    requests = [GenerationRequest(f"eval-{i}", encode_prompt(tokenizer, p["prompt"], chat_template), params)
                for i, p in enumerate(problems)]
    with torch.inference_mode():
        return [r.output_text for r in engine.generate(requests)]


def greedy_accuracy(
    engine_or_model, tokenizer, task, problems: list[dict], max_batch_size: int = 128, chat_template: bool | None = None
) -> float:
    """Fraction of ``problems`` whose greedy completion (``greedy_answers``, same
    arguments) earns ``task.reward(output_text, problem["answer"]) == 1``; ``0.0`` for an
    empty list. Raises as ``greedy_answers``."""
    return answer_accuracy(task, greedy_answers(engine_or_model, tokenizer, task, problems, max_batch_size,
                                                chat_template), problems)


def answer_accuracy(task, answers: list[str], problems: list[dict]) -> float:
    """Mean ``task.reward(answer, problem["answer"])`` over paired ``answers`` and
    ``problems``; ``0.0`` for empty lists."""
    scores = [task.reward(text, p["answer"]) for text, p in zip(answers, problems)]
    return sum(scores) / len(scores) if scores else 0.0


EVAL_TASKS = ("gsm8k", "arith", "arith-chat", "longtail")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct.

    Chen et al. 2021, "Evaluating Large Language Models Trained on Code" (arXiv:2107.03374),
    eq. 1: ``pass@k = 1 - C(n - c, k) / C(n, k)``, computed as the product
    ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (their numerically stable form); 1.0 when
    ``n - c < k`` (every k-subset holds a correct sample).

    Raises:
        ValueError: not ``0 <= c <= n`` or not ``1 <= k <= n``.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def sampled_correct(engine, tokenizer, task, problems: list[dict], n_samples: int, temperature: float = 1.0,
                    top_p: float = 1.0, chat_template: bool | None = None) -> list[int]:
    """Correct samples per problem: ``n_samples`` completions each (``temperature``,
    ``top_p``, up to ``task.max_answer_tokens``), scored by ``task.reward == 1``.

    Returns:
        ``[c_0, c_1, ...]``, one count in ``[0, n_samples]`` per problem, in order.

    Raises:
        ValueError: ``temperature <= 0`` (greedy samples are all equal; use ``greedy_answers``).
    """
    if temperature <= 0:
        raise ValueError(f"sampled_correct: temperature must be > 0 for pass@k, got {temperature}")
    params = SamplingParams(temperature=temperature, top_p=top_p,
                            max_new_tokens=getattr(task, "max_answer_tokens", 16))
    requests = [GenerationRequest(f"s-{i}-{j}", encode_prompt(tokenizer, p["prompt"], chat_template), params,
                                  meta={"i": i}) for i, p in enumerate(problems) for j in range(n_samples)]
    counts = [0] * len(problems)
    with torch.inference_mode():
        for result in engine.generate(requests):
            i = result.meta["i"]
            counts[i] += task.reward(result.output_text, problems[i]["answer"]) == 1
    return counts


def build_eval_task(name: str, seed: int = 1, max_digits: int = 2, dataset_path: str = ""):
    """The task of ``areal-flow eval --task``: ``gsm8k`` (shipped test split, or
    ``dataset_path``), ``arith`` (the main job's: ``max_digits``-digit ``+``/``-``, plain
    prompts), ``arith-chat`` (the same problems as chat questions), ``longtail`` (count on
    from a number, ``graphs/longtail_grpo.py``'s task). ``seed`` fixes the arithmetic and
    long-tail test sets as a run's ``seed`` does.

    Raises:
        ValueError: an unknown task name, listing the known ones.
    """
    if name == "gsm8k":
        from areal_flow.tasks.gsm8k import GSM8KTask

        return GSM8KTask(path=dataset_path or None, seed=seed)
    if name in ("arith", "arith-chat"):
        from areal_flow.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(seed=seed, max_digits=max_digits, prompt_style="chat" if name == "arith-chat" else "plain")
    if name == "longtail":
        from areal_flow.tasks.longtail import LongTailTask

        return LongTailTask(seed=seed)
    raise ValueError(f"--task {name!r}: expected one of {', '.join(EVAL_TASKS)}")


def evaluate_model(spec: str, task_name: str, n: int = 500, samples: int = 0, temperature: float = 1.0,
                   cfg=None, max_digits: int = 2, max_batch_size: int = 64, progress: bool = True) -> dict:
    """Greedy accuracy (pass@1 at temperature 0) and, with ``samples = k >= 1``, sampled
    pass@1..pass@k (``pass_at_k``, averaged over problems) on the first ``n`` test problems.

    Args:
        spec: a preset (``tiny-arith``: evaluated after its cached warm start under
            ``cfg.warm_start``; ``smollm2-135m``), a ``transformers`` folder (a run's
            ``runs/<name>/model`` or a checkpoint), a ``.gguf`` file, or a cached hub id.
        task_name: one of ``EVAL_TASKS``.
        n: test problems (fewer if the test split is smaller).
        samples: completions per problem for pass@k; 0 = greedy only.
        temperature: sampling temperature of the pass@k samples.
        cfg: an ``ExperimentConfig`` (seed, model.dtype, warm_start, dataset.path);
            None = the defaults.
        max_digits: arithmetic operands' digits (2: the main job's).
        progress: show a tqdm bar over batches of problems.

    Returns:
        ``{"model", "task", "n", "greedy_accuracy", "samples", "temperature",
        "pass_at_k": {"1": ..., "k": ...}, "wall_s"}`` (pass@k for k = 1, 2, 4, ..., samples).

    Raises:
        ValueError: bad task name, ``n < 1`` or ``samples < 0``; the model loaders' errors
        (ModuleNotFoundError, FileNotFoundError, OSError) naming ``spec``.
    """
    from areal_flow.config import ExperimentConfig
    from areal_flow.models.names import resolve_name
    from runtime.model_source import load_pretrained, prepare_initial_model

    if n < 1 or samples < 0:
        raise ValueError(f"--n must be >= 1 and --samples >= 0, got n={n}, samples={samples}")
    cfg = cfg or ExperimentConfig()
    start = time.perf_counter()
    task = build_eval_task(task_name, cfg.seed, max_digits, cfg.dataset.path)
    ref = resolve_name(spec)  # as compile and run resolve it
    if ref.kind == "tiny":
        cfg.model.path = ref.preset
        folder = prepare_initial_model(cfg, task, progress=progress)
    else:
        from areal_flow.models.hf import folder_of

        folder = folder_of(ref)
    model, tokenizer = load_pretrained(folder, cfg.model.dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    engine = GenerationEngine(model, tokenizer, max_batch_size=max_batch_size)
    problems = task.test_set(n)
    chunk = max(1, max_batch_size // max(1, samples))
    greedy, counts = [], []
    bar = tqdm(total=len(problems), desc=f"eval {task_name}", unit="problem", disable=not progress)
    for first in range(0, len(problems), chunk):
        part = problems[first:first + chunk]
        greedy += greedy_answers(engine, tokenizer, task, part)
        if samples:
            counts += sampled_correct(engine, tokenizer, task, part, samples, temperature)
        bar.update(len(part))
    bar.close()
    ks = sorted({1, samples, *[2 ** e for e in range(1, 12) if 2 ** e < samples]}) if samples else []
    return {
        "model": spec, "folder": str(Path(folder)), "task": task_name, "n": len(problems),
        "greedy_accuracy": answer_accuracy(task, greedy, problems), "samples": samples,
        "temperature": temperature if samples else 0.0,
        "pass_at_k": {str(k): sum(pass_at_k(samples, c, k) for c in counts) / len(counts) for k in ks},
        "wall_s": round(time.perf_counter() - start, 2),
    }


def evaluate_episodes(model, tokenizer, attrs: dict, rows: list[dict], *, temperature: float = 0.0,
                      max_context: int, seed: int = 0, failure_log=None) -> dict:
    """Held-out episodes of ``model`` for a rollout node: one episode per row, sampled at
    ``temperature`` (0 = greedy) on the embedded engine.

    Args:
        attrs: the rollout node's attributes (env or agent, ``max_turns``, ``gamma``, ...).
        rows: the held-out dataset rows.
        max_context: tokens of prompt + turns at most.
        failure_log: where the first traceback of each distinct episode error goes (a path;
            ``runtime.executors.episode_failures``; None: nowhere).

    Returns:
        ``{"accuracy": fraction of rows whose episode the env reported a ``success`` (or
        ``resolved``) > 0 for (agent episodes: a return > 0), "return": mean discounted
        return, "turns": mean policy turns, "env/<key>": mean per episode of each numeric
        info key, "failed": episodes that failed}``.
    """
    from runtime.engines.generation import GenerationEngine
    from runtime.executors.rollout import episode_correct, play_episodes

    engine = GenerationEngine(model, tokenizer, max_batch_size=min(64, max(1, len(rows))), seed=seed)
    trajs = play_episodes(engine, tokenizer, {**attrs, "temperature": temperature, "top_p": 1.0}, rows, max_context,
                          failure_log)
    n = max(len(trajs), 1)

    def success(t) -> bool:  # as training judges an episode; an env that reports no success: not one
        return bool(episode_correct(t.meta.get("env", {}), t.reward, attrs.get("agent") is not None))

    out = {"accuracy": sum(success(t) for t in trajs) / max(len(rows), 1),
           "return": sum(float(t.reward) for t in trajs) / n, "turns": sum(t.meta["turns"] for t in trajs) / n,
           "failed": len(rows) - len(trajs)}
    for key in sorted({k for t in trajs for k in t.meta.get("env", {})}):
        out[f"env/{key}"] = sum(t.meta["env"].get(key, 0.0) for t in trajs) / n
    return out
