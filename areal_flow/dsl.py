"""The ``@flow`` DSL: tracing a Python function into a :class:`~areal_flow.graph.Graph`.

Owns tracing only. Calling a ``@flow`` function with a config runs its body once with
a trace context active: every ``ops.*`` call records a node and returns symbolic
:class:`Handle` values; passing a handle into another op records a data edge. Nothing
is computed while tracing. It must not know how nodes run or where.
"""

from __future__ import annotations

import functools
import inspect
import traceback
from typing import Any, Callable

from areal_flow.graph import Graph, GraphError
from areal_flow.ops.registry import op_specs
from areal_flow.tracing import Handle, Model, trace_into

__all__ = ["Flow", "Handle", "Model", "flow"]

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
    :class:`Graph`. A graph file's ``python graphs/x.py`` entry point is
    ``areal_flow.cli.run_main(flow)`` (the same as ``areal-flow run graphs/x.py``): the DSL
    imports no CLI.
    """

    def __init__(self, fn: Callable[[Any], Any]):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = fn.__name__
        self.source_file = inspect.getsourcefile(fn)

    def __call__(self, cfg: Any) -> Graph:
        graph = Graph(self.name, op_specs())
        try:
            with trace_into(graph, self.name):
                result = self.fn(cfg)
        except _PLAIN_ERRORS as exc:
            if type(exc) not in _PLAIN_ERRORS:  # GraphError, ConfigError, ...: they name their culprit
                raise
            raise GraphError(f"{_graph_line(exc, self.source_file)}: {type(exc).__name__}: {exc}") from None
        results = result if isinstance(result, (tuple, list)) else [result]
        graph.outputs = [(h.node, h.port) for h in results if isinstance(h, Handle)]
        return graph.validate()


def flow(fn: Callable[[Any], Any]) -> Flow:
    """Decorator: declare an RL algorithm as a graph. See :class:`Flow`."""
    return Flow(fn)
