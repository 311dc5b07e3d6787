"""``ops.sync_weights``: the weight channel from a model's trainer to a ``generate``.

Port schema: input ``weights`` (from the node that trains the model: its ``train_step``, or a
user op registered with role ``training``), output
``weights`` (into the ``generate`` node whose rollouts handle is ``to``). Both edges are
``weights`` edges: they close the RL loop without a deadlock, since the generator keeps
sampling with the version it has until newer weights arrive.
"""

from __future__ import annotations

from areal_flow.dtypes import DTYPES, ENGINE, wire_dtype_name
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
def sync_weights(model: Model, *, to: Handle, weights_dtype: str | None = None, name: str | None = None) -> None:
    """Declare that ``model``'s new weights go to the generator that produced ``to``.

    Args:
        weights_dtype: the dtype the weight matrices travel in (float32, bfloat16, float16, any
            spelling of ``model.dtype``; vectors and the LM head keep theirs:
            ``runtime.weight_wire.cast_on_wire``), or ``engine``: the dtype each engine announces at
            start; None: the compiler derives it from the generator's ``gen.dtype`` and
            ``model.dtype`` (``areal_flow.dtypes.weights_dtype``: 16-bit where the engine decodes in
            16 bits, which halves those bytes at no loss).

    Raises:
        GraphError: no trainer of ``model`` (``train_step``) was declared before this call, ``to``
            is not a handle, or ``weights_dtype`` is no dtype (naming the node and line).
    """
    node = record(SPEC, {}, model=model, attrs={} if weights_dtype is None else {"weights_dtype": weights_dtype},
                  name=name)
    if weights_dtype is not None and wire_dtype_name(weights_dtype) is None:
        raise GraphError(f"{node.where()}: weights_dtype={weights_dtype!r}: expected one of {', '.join(DTYPES)} "
                         f"or {ENGINE}")
    graph = current_graph()
    if not isinstance(to, Handle):
        raise GraphError(f"{node.where()}: 'to' must be the rollouts handle of a generate node, got {to!r}")
    writers = [n for n in graph.trainers() if n.model == model.name]
    if not writers:
        raise GraphError(f"{node.where()}: no train_step updates model '{model.name}' (declare it before sync_weights)")
    graph.add_edge(Edge(writers[0].name, "weights", node.name, "weights", WEIGHTS))
    graph.add_edge(Edge(node.name, "weights", to.node, "weights", WEIGHTS))
