"""``ops.generate``: sample ``n_samples`` responses (a group) for every prompt with a policy.

Port schema: input ``prompts`` (and the optional ``weights`` input that
``ops.sync_weights`` connects); output ``rollouts`` (a group of
:class:`~areal_flow.types.Trajectory`). The work itself is done by the generation
engine (``runtime.engines.generation``) that the runtime builds for this node; the
worker turns each task prompt into token ids with :func:`encode_prompt` (the task stays
tokenizer-free, chat formatting happens here).
"""

from __future__ import annotations

from areal_flow.tracing import Handle, Model, outputs, record
from areal_flow.graph import GraphError, OpSpec, PortSpec
from areal_flow.ops.registry import GENERATION, STREAM, OpDef, define, op_function

SPEC = OpSpec(
    "generate",
    inputs=(PortSpec("prompts", "prompts"), PortSpec("weights", "weights", required=False)),
    outputs=(PortSpec("rollouts", "rollouts"),),
    needs_model=True,
)
OP = define(OpDef(SPEC, STREAM, GENERATION, "runtime.executors.generate:GenerateExecutor"))
ENGINES = ("embedded", "vllm")


@op_function
def generate(
    policy: Model,
    prompts: Handle,
    *,
    n_samples: int = 1,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    top_p: float = 1.0,
    chat_template: bool | None = None,
    engine: str = "embedded",
    name: str | None = None,
) -> Handle:
    """Declare rollout generation.

    Args:
        policy: the model that samples (the behavior policy at its current version).
        prompts: a ``prompts`` handle (from ``ops.dataset``).
        n_samples: responses per prompt (the group size of GRPO/RLOO).
        max_new_tokens: response length limit, tokens.
        temperature: sampling temperature (0 = greedy).
        top_p: nucleus sampling mass.
        chat_template: wrap each prompt as one user turn of the tokenizer's chat template
            (see :func:`encode_prompt`); None = when the tokenizer has one.
        engine: ``"embedded"`` (``runtime.engines.generation``, any device) or ``"vllm"``
            (``runtime.engines.vllm_engine``; needs the ``vllm`` package on the worker).

    Raises:
        GraphError: naming the node and line, when an argument is out of range.
    """
    node = record(
        SPEC,
        {"prompts": prompts},
        model=policy,
        attrs=dict(n_samples=n_samples, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                   chat_template=chat_template, engine=engine),
        name=name,
    )
    check_sampling(node)
    return outputs(node, SPEC)


def check_sampling(node) -> None:
    """The sampling attributes every generator shares (``generate``, ``rollout``).

    Raises:
        GraphError: naming the node and line, when one is out of range.
    """
    a = node.attrs
    for bad, rule in ((a["n_samples"] < 1, f"n_samples={a['n_samples']}: must be >= 1"),
                      (a["max_new_tokens"] < 1, f"max_new_tokens={a['max_new_tokens']}: must be >= 1"),
                      (a["temperature"] < 0, f"temperature={a['temperature']}: must be >= 0"),
                      (not 0 < a["top_p"] <= 1, f"top_p={a['top_p']}: must be in (0, 1]"),
                      (a["engine"] not in ENGINES, f"engine={a['engine']!r}: expected one of {', '.join(ENGINES)}")):
        if bad:
            raise GraphError(f"{node.where()}: {rule}")


def encode_prompt(tokenizer, text: str, chat_template: bool | None = None) -> list[int]:
    """Token ids of a task prompt, as the generator feeds them to the policy.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        text: the task's bare prompt (a question, ``"37+58="``).
        chat_template: True: format ``text`` as one user turn with the tokenizer's chat
            template (``areal_flow.models.hf.apply_chat_template``, the template's default
            system turn, an open assistant turn) and encode it without adding special
            tokens again; False: ``tokenizer.encode(text)`` (e.g. ``<bos>`` + characters
            for the char tokenizer); None: True when the tokenizer has a chat template.

    Returns:
        ``[prompt_len]`` token ids.

    Raises:
        ValueError: ``chat_template=True`` and the tokenizer has no chat template.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template is None:
        chat_template = has_template
    if not chat_template:
        return list(tokenizer.encode(text))
    from areal_flow.models.hf import apply_chat_template

    return list(tokenizer.encode(apply_chat_template(tokenizer, text), add_special_tokens=False))
