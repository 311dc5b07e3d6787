"""Tracing primitives: the symbolic values and the node recorder that ``ops.*`` calls use.

Owns the trace context (the graph being traced, one per thread), :class:`Handle` (a node's
output port, symbolic), :class:`Model` and :func:`record` (add a node and its data edges,
naming the graph file's line). ``areal_flow.dsl`` opens and closes the context around a
``@flow`` function; nothing here computes anything or knows how nodes run.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from areal_flow.graph import DATA, Edge, Graph, GraphError, ModelRef, Node, OpSpec

_state = threading.local()


@dataclass(frozen=True)
class Handle:
    """A symbolic value: output ``port`` of node ``node``, carrying values of ``type``."""

    node: str
    port: str
    type: str

    def __repr__(self) -> str:
        return f"<{self.type} from {self.node}.{self.port}>"


@dataclass(frozen=True)
class Model:
    """A model used by a graph.

    Args:
        name: graph-level name, e.g. ``"policy"``.
        spec: preset name, HF folder, GGUF file or hub id; or a config object with a
            ``path`` attribute (e.g. :class:`~areal_flow.config.ModelConfig`).
        trainable: False for frozen models (reference policy, reward model).
    """

    name: str
    spec: Any = None
    trainable: bool = True

    def ref(self) -> ModelRef:
        spec = getattr(self.spec, "path", self.spec)
        return ModelRef(self.name, str(spec), self.trainable)


def current_graph() -> Graph:
    """The graph being traced. Raises RuntimeError outside a ``@flow`` call."""
    graph = getattr(_state, "graph", None)
    if graph is None:
        raise RuntimeError("ops.* can only be called while tracing a @flow function (call the flow with a config)")
    return graph


def user_source() -> str:
    """``file:line`` of the first stack frame outside areal_flow: the graph file's line."""
    here = os.path.dirname(os.path.abspath(__file__))
    for frame in inspect.stack()[2:]:
        path = os.path.abspath(frame.filename)
        if not path.startswith(here):
            return f"{os.path.relpath(path) if not os.path.relpath(path).startswith('..') else path}:{frame.lineno}"
    return "<unknown>"


def record(
    spec: OpSpec,
    inputs: dict[str, Any],
    *,
    model: Model | None = None,
    attrs: dict | None = None,
    name: str | None = None,
    staleness: dict[str, int] | None = None,
) -> Node:
    """Record a node of op ``spec`` with data ``inputs`` (port -> Handle); used by ``ops.*``.

    Raises:
        GraphError: an input is not a Handle (naming the op, port and source line),
            or a port name is unknown.
    """
    graph = current_graph()
    source = user_source()
    if model is not None:
        if not isinstance(model, Model):
            raise GraphError(f"{spec.name} at {source}: expected a Model, got {type(model).__name__}")
        graph.add_model(model.ref())
    node = Node(
        name=graph.unique_name(name or spec.name),
        op=spec.name,
        model=model.name if model is not None else None,
        attrs=dict(attrs or {}),
        source=source,
    )
    graph.add_node(node)
    for port, value in inputs.items():
        if value is None:
            continue
        if not isinstance(value, Handle):
            raise GraphError(
                f"{node.where()}: input '{port}' must be the output of another op (a Handle), "
                f"got {type(value).__name__}"
            )
        if spec.input(port) is None:
            raise GraphError(f"{node.where()}: op '{spec.name}' has no input port '{port}'")
        graph.add_edge(Edge(value.node, value.port, node.name, port, DATA, (staleness or {}).get(port)))
    return node


def outputs(node: Node, spec: OpSpec) -> Handle:
    """The Handle of the node's first data output port."""
    port = next(p for p in spec.outputs if p.kind == DATA)
    return Handle(node.name, port.name, port.type)


@contextlib.contextmanager
def trace_into(graph: Graph, flow_name: str) -> Iterator[Graph]:
    """Make ``graph`` the graph that ``ops.*`` calls record into, for the ``with`` block.

    Raises:
        RuntimeError: another flow is being traced in this thread.
    """
    if getattr(_state, "graph", None) is not None:
        raise RuntimeError(f"flow '{flow_name}' called while another flow is being traced")
    _state.graph = graph
    try:
        yield graph
    finally:
        _state.graph = None
