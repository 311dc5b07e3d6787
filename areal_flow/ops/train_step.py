"""``ops.train_step``: one optimizer step of a model on a batch of advantaged trajectories.

Port schema: input ``advantages`` (a bounded-staleness data edge: ``max_staleness`` = k);
outputs ``stats`` (metrics) and ``weights`` (the new parameters, on the weight channel,
which ``ops.sync_weights`` routes to a generator). Each step increments the model's
policy version. The update itself is ``areal_flow.algorithms`` (picked by ``algorithm``).
A ``train_step`` of a critic (the model an ``advantage`` node reads as ``critic=``) trains
the value model on the returns of that node (clipped value loss), in its own node.
The staleness bound k is an attribute of the data edge into this node, nowhere else.
"""

from __future__ import annotations

from areal_flow.algorithms.catalog import algorithm_info, algorithm_names
from areal_flow.tracing import Handle, Model, outputs, record
from areal_flow.graph import GraphError, OpSpec, PortSpec
from areal_flow.ops.registry import BATCH, TRAINING, OpDef, define, op_function

SPEC = OpSpec(
    "train_step",
    inputs=(PortSpec("advantages", "advantages"),),
    outputs=(PortSpec("stats", "stats"), PortSpec("weights", "weights")),
    needs_model=True,
    trains=True,
)
OP = define(OpDef(SPEC, BATCH, TRAINING, "runtime.executors.train:TrainStepExecutor"))


@op_function
def train_step(
    model: Model,
    advantages: Handle,
    *,
    algorithm: str = "grpo",
    max_staleness: int = 0,
    name: str | None = None,
) -> Handle:
    """Declare the training node of ``model``.

    Args:
        model: the model it updates (exactly one train_step per model).
        advantages: ``advantages`` handle from ``ops.advantage``.
        algorithm: registered algorithm name (``areal_flow.algorithms``).
        max_staleness: k >= 0; a sample is trained at most k versions after the version
            that generated its first token. 0 = synchronous (a barrier per step).

    Returns:
        Handle of type ``stats``.

    Raises:
        GraphError: negative or non-integer ``max_staleness``, or an algorithm that is
            neither built in nor registered (naming the node and line).
    """
    node = record(
        SPEC,
        {"advantages": advantages},
        model=model,
        attrs={"algorithm": algorithm},  # k lives on the data edge only (one source)
        name=name,
        staleness={"advantages": max_staleness},
    )
    if not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness < 0:
        raise GraphError(f"{node.where()}: max_staleness must be an int >= 0, got {max_staleness!r}")
    if algorithm_info(algorithm) is None:
        raise GraphError(f"{node.where()}: unknown algorithm {algorithm!r}; registered: {', '.join(algorithm_names())}")
    return outputs(node, SPEC)
