"""``ops.sync_weights``: the weight channel from a model's trainer to a ``generate``.

Port schema: input ``weights`` (from the node that trains the model: its ``train_step``, or a
user op registered with role ``training``), output
``weights`` (into the ``generate`` node whose rollouts handle is ``to``). Both edges are
``weights`` edges: they close the RL loop without a deadlock, since the generator keeps
sampling with the version it has until newer weights arrive.
"""

from __future__ import annotations

from areal_flow.tracing import Handle, Model, current_graph, record
from areal_flow.graph import WEIGHTS, Edge, GraphError, OpSpec, PortSpec
from areal_flow.ops.registry import CPU, ROUTE, OpDef, define, op_function

SPEC = OpSpec(
    "sync_weights",
    inputs=(PortSpec("weights", "weights"),),
    outputs=(PortSpec("weights", "weights"),),
    needs_model=True,
)
OP = define(OpDef(SPEC, ROUTE, CPU))


@op_function
def sync_weights(model: Model, *, to: Handle, name: str | None = None) -> None:
    """Declare that ``model``'s new weights go to the generator that produced ``to``.

    Raises:
        GraphError: no trainer of ``model`` (``train_step``) was declared before this call, or
            ``to`` is not a handle (naming the node and line).
    """
    node = record(SPEC, {}, model=model, name=name)
    graph = current_graph()
    if not isinstance(to, Handle):
        raise GraphError(f"{node.where()}: 'to' must be the rollouts handle of a generate node, got {to!r}")
    writers = [n for n in graph.trainers() if n.model == model.name]
    if not writers:
        raise GraphError(f"{node.where()}: no train_step updates model '{model.name}' (declare it before sync_weights)")
    graph.add_edge(Edge(writers[0].name, "weights", node.name, "weights", WEIGHTS))
    graph.add_edge(Edge(node.name, "weights", to.node, "weights", WEIGHTS))
