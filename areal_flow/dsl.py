"""The ``@flow`` DSL: tracing a Python function into a :class:`~areal_flow.graph.Graph`.

Owns tracing only. Calling a ``@flow`` function with a config runs its body once with
a trace context active: every ``ops.*`` call records a node and returns symbolic
:class:`Handle` values; passing a handle into another op records a data edge. Nothing
is computed while tracing. It must not know how nodes run or where.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable

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


_PLAIN_ERRORS = (TypeError, ValueError, KeyError, AttributeError, NameError, IndexError)
"""Built-in errors a graph function raises on bad op arguments (an unknown keyword, a wrong
count): :class:`Flow` turns them into a :class:`GraphError` naming the graph file's line."""


def _graph_line(exc: BaseException, source_file: str | None) -> str:
    """``<file>:<line>`` of the innermost frame of ``exc``'s traceback in ``source_file``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == source_file]
    return f"{source_file}:{frames[-1].lineno}" if frames else str(source_file)


class Flow:
    """A traced algorithm: calling it with a config returns the validated Graph.

    ``flow(cfg)`` runs the decorated function once under a trace context and returns a
    :class:`Graph`; ``flow.main()`` is the ``python graphs/x.py`` entry point (the same
    as ``areal-flow run graphs/x.py``).
    """

    def __init__(self, fn: Callable[[Any], Any]):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = fn.__name__
        self.source_file = inspect.getsourcefile(fn)

    def __call__(self, cfg: Any) -> Graph:
        from areal_flow.ops.registry import op_specs  # imported late: ops import this module

        if getattr(_state, "graph", None) is not None:
            raise RuntimeError(f"flow '{self.name}' called while another flow is being traced")
        graph = Graph(self.name, op_specs())
        _state.graph = graph
        try:
            result = self.fn(cfg)
        except _PLAIN_ERRORS as exc:
            if type(exc) not in _PLAIN_ERRORS:  # GraphError, ConfigError, ...: they name their culprit
                raise
            raise GraphError(f"{_graph_line(exc, self.source_file)}: {type(exc).__name__}: {exc}") from None
        finally:
            _state.graph = None
        results = result if isinstance(result, (tuple, list)) else [result]
        graph.outputs = [(h.node, h.port) for h in results if isinstance(h, Handle)]
        return graph.validate()

    def main(self, argv: list[str] | None = None) -> int:
        """Run this flow from the command line: ``python graphs/x.py [--config Y] key=value ...``."""
        from areal_flow.cli import run_main

        return run_main(self, argv)


def flow(fn: Callable[[Any], Any]) -> Flow:
    """Decorator: declare an RL algorithm as a graph. See :class:`Flow`."""
    return Flow(fn)
