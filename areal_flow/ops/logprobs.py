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
    """Worker side (grain ``group``): ``{"logprobs": Logprobs}``, ``[n][response_len]``."""

    def __init__(self, node, ctx) -> None:
        self.node = node
        self.model = ctx.model(node.model)
        self.temperature = node.attrs["temperature"]
        self.pad_id = ctx.pad_id

    def run(self, inputs: dict, info: dict) -> dict:
        import torch

        from areal_flow.models.logprobs import token_logprobs
        from areal_flow.batching import pad_tokens

        group = inputs["rollouts"]
        ids, attn = pad_tokens(group, self.pad_id)
        with torch.no_grad():
            lp = token_logprobs(self.model, ids, attn, temperature=self.temperature)
        out = []
        for row, t in enumerate(group):
            p = len(t.prompt_ids)
            out.append(lp[row, p:p + len(t.output_ids)].tolist())
        return {"logprobs": Logprobs(out)}
