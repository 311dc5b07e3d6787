"""The node kinds of areal-flow graphs, one module each, and their registry.

Each module declares its op (``OP``: port schema, compiler role, grain, executor) in
``areal_flow.ops.registry`` and the function that records its node while a ``@flow`` is
traced. A user adds a node kind from a graph file with :func:`register_op`. Any other
public name (``ops.genrate``) raises :class:`UnknownOpError` naming the graph file's line
and the nearest op.
"""

import difflib

from areal_flow.tracing import user_source
from areal_flow.graph import GraphError
# each module registers its op (OP) in areal_flow.ops.registry when imported
from areal_flow.ops.advantage import advantage
from areal_flow.ops.dataset import dataset
from areal_flow.ops.filter import filter  # noqa: A004
from areal_flow.ops.generate import generate
from areal_flow.ops.logprobs import logprobs
from areal_flow.ops.registry import OPS, register_op
from areal_flow.ops.replay import replay
from areal_flow.ops.reward import reward
from areal_flow.ops.rollout import rollout
from areal_flow.ops.sync_weights import sync_weights
from areal_flow.ops.train_step import train_step


class UnknownOpError(GraphError, AttributeError):
    """``ops.<name>`` for a name that is no op. A ``GraphError`` (the CLI prints one line,
    exit 2) and an ``AttributeError`` (``hasattr(ops, name)`` stays False)."""


def __getattr__(name: str):
    """Called for names this module lacks. Raises UnknownOpError (AttributeError for ``_`` names)."""
    if name.startswith("_"):
        raise AttributeError(f"module 'areal_flow.ops' has no attribute {name!r}")
    near = difflib.get_close_matches(name, OPS, n=1)
    hint = f"did you mean ops.{near[0]}? " if near else ""
    raise UnknownOpError(f"ops.{name} ({user_source()}): no such op; {hint}ops: {', '.join(sorted(OPS))}")


__all__ = ["OPS", "UnknownOpError", "advantage", "dataset", "filter", "generate", "logprobs", "register_op", "replay",
           "reward", "rollout",
           "sync_weights", "train_step"]
