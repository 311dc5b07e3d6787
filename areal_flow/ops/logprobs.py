"""``ops.logprobs``: per-token log-probs of a group's trajectories under a frozen model.

Port schema: input ``rollouts``; output ``logprobs`` (per trajectory, one float per
response token, natural log, at the generate node's sampling temperature). The model is
forward-only (a reference policy, ``Model(..., trainable=False)``): for the compiler an
``inference`` node. Its typical consumer is ``ops.advantage(..., ref_logprobs=...)``, which
folds ``-kl_coef * KL(policy || ref)`` into the token rewards, and the train_step's KL loss.
"""

from __future__ import annotations

from areal_flow.tracing import Handle, Model, outputs, record
from areal_flow.graph import GraphError, OpSpec, PortSpec
from areal_flow.ops.registry import GROUP, INFERENCE, OpDef, define, op_function
from areal_flow.values import Logprobs

SPEC = OpSpec("logprobs", inputs=(PortSpec("rollouts", "rollouts"),), outputs=(PortSpec("logprobs", "logprobs"),),
              needs_model=True)
OP = define(OpDef(SPEC, GROUP, INFERENCE, "areal_flow.ops.logprobs:LogprobsExecutor"))


@op_function
def logprobs(model: Model, rollouts: Handle, *, temperature: float = 1.0, name: str | None = None) -> Handle:
    """Declare a forward-only log-prob node of a frozen ``model`` over ``rollouts``.

    Args:
        temperature: logits are divided by it (use the generate node's, so the log-probs
            are of the same distribution family as the behavior log-probs).

    Raises:
        GraphError: a trainable ``model`` or ``temperature <= 0`` (naming the node and line).
    """
    node = record(SPEC, {"rollouts": rollouts}, model=model, attrs={"temperature": temperature}, name=name)
    if model.trainable:
        raise GraphError(f"{node.where()}: model '{model.name}' must be declared Model(..., trainable=False) "
                         "(a logprobs node reads a frozen model)")
    if not temperature > 0:
        raise GraphError(f"{node.where()}: temperature={temperature}: must be > 0")
    return outputs(node, SPEC)


class LogprobsExecutor:
    """Worker side (grain ``group``): ``{"logprobs": Logprobs}``, ``[n][response_len]``.

    One no-grad pass of the group's rows (right-padded, ``[n, T]``); the LM head runs only from
    the column before the group's earliest response token on (``transformers``'
    ``logits_to_keep``, the rule of ``areal_flow.algorithms.model_runner.head_skip``, as the
    trainer's own log-prob pass): the prompt's logits are never read."""

    def __init__(self, node, ctx) -> None:
        from areal_flow.algorithms.model_runner import takes_logits_to_keep

        self.node = node
        self.model = ctx.model(node.model)
        self.temperature = node.attrs["temperature"]
        self.pad_id = ctx.pad_id
        self.keeps = takes_logits_to_keep(self.model)

    def run(self, inputs: dict, info: dict) -> dict:
        import torch

        from areal_flow.algorithms.model_runner import head_skip, kept_token_outputs
        from areal_flow.batching import pad_tokens
        from areal_flow.models.logprobs import model_logits

        group = inputs["rollouts"]
        ids, attn = pad_tokens(group, self.pad_id)
        width = ids.shape[1]
        skip = head_skip(min(len(t.prompt_ids) for t in group), width) if self.keeps else 0
        with torch.no_grad():
            logits = model_logits(self.model, ids, attn, logits_to_keep=width - skip if skip else 0)
            lp, _ = kept_token_outputs(logits, ids, self.temperature, skip, entropy_grad=None)
        out = []
        for row, t in enumerate(group):
            p = len(t.prompt_ids)
            out.append(lp[row, p:p + len(t.output_ids)].tolist())
        return {"logprobs": Logprobs(out)}
