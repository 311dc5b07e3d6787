"""``ops.train_step``: one optimizer step of a model on a batch of advantaged trajectories.

Port schema: input ``advantages`` (a bounded-staleness data edge: ``max_staleness`` = k);
outputs ``stats`` (metrics) and ``weights`` (the new parameters, on the weight channel,
which ``ops.sync_weights`` routes to a generator). Each step increments the model's
policy version. The update itself is ``areal_flow.algorithms`` (picked by ``algorithm``).
A ``train_step`` of a critic (the model an ``advantage`` node reads as ``critic=``) trains
the value model on the returns of that node (clipped value loss), in its own node.
The staleness bound k is an attribute of the data edge into this node, nowhere else; its
default is ``areal_flow.graph.DEFAULT_MAX_STALENESS`` (2, also ``async.max_staleness``'s).
The algorithm is decided here, while the graph is traced: the ``advantage`` node that feeds
this one gets the algorithm's estimator if it named none (``ops.advantage.settle_estimator``);
one it named is checked against the algorithm by the graph's rules.
"""

from __future__ import annotations

import difflib

from areal_flow.algorithms.catalog import algorithm_info, algorithm_names
from areal_flow.tracing import Handle, Model, current_graph, outputs, record
from areal_flow.graph import DEFAULT_MAX_STALENESS, GraphError, OpSpec, PortSpec
from areal_flow.ops.advantage import settle_estimator
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
    max_staleness: int = DEFAULT_MAX_STALENESS,
    name: str | None = None,
) -> Handle:
    """Declare the training node of ``model``.

    Args:
        model: the model it updates (exactly one train_step per model).
        advantages: ``advantages`` handle from ``ops.advantage``.
        algorithm: registered algorithm name (``areal_flow.algorithms``).
        max_staleness: k >= 0; a sample is trained at most k versions after the version
            that generated its first token. 0 = synchronous (a barrier per step); the
            default, 2, is ``async.max_staleness``'s (the graph validation checks it).

    Returns:
        Handle of type ``stats``.

    Raises:
        GraphError: an algorithm that is neither built in nor registered, or an estimator
            knob the algorithm's estimator does not take (naming the node and line).
    """
    node = record(
        SPEC,
        {"advantages": advantages},
        model=model,
        attrs={"algorithm": algorithm},  # k lives on the data edge only (one source)
        name=name,
        staleness={"advantages": max_staleness},
    )
    info = algorithm_info(algorithm)
    if info is None:
        near = difflib.get_close_matches(str(algorithm), algorithm_names(), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise GraphError(f"{node.where()}: unknown algorithm {algorithm!r}{hint}; registered: "
                         f"{', '.join(algorithm_names())}")
    adv = current_graph().source_of(node.name, "advantages", "advantage")
    if adv is not None:
        settle_estimator(adv, info)
    return outputs(node, SPEC)
