"""The node kinds of areal-flow graphs, one module each.

``OP_SPECS`` maps an op name to its port schema; the functions below record nodes
while a ``@flow`` is being traced. Any other public name (``ops.genrate``) raises
:class:`UnknownOpError` naming the graph file's line and the nearest op.
"""

import difflib

from areal_flow.dsl import user_source
from areal_flow.graph import GraphError
from areal_flow.ops import advantage as _advantage
from areal_flow.ops import dataset as _dataset
from areal_flow.ops import generate as _generate
from areal_flow.ops import reward as _reward
from areal_flow.ops import sync_weights as _sync_weights
from areal_flow.ops import train_step as _train_step
from areal_flow.ops.advantage import advantage
from areal_flow.ops.dataset import dataset
from areal_flow.ops.generate import generate
from areal_flow.ops.reward import reward
from areal_flow.ops.sync_weights import sync_weights
from areal_flow.ops.train_step import train_step

OP_SPECS = {
    m.SPEC.name: m.SPEC for m in (_dataset, _generate, _reward, _advantage, _train_step, _sync_weights)
}


class UnknownOpError(GraphError, AttributeError):
    """``ops.<name>`` for a name that is no op. A ``GraphError`` (the CLI prints one line,
    exit 2) and an ``AttributeError`` (``hasattr(ops, name)`` stays False)."""


def __getattr__(name: str):
    """Called for names this module lacks. Raises UnknownOpError (AttributeError for ``_`` names)."""
    if name.startswith("_"):
        raise AttributeError(f"module 'areal_flow.ops' has no attribute {name!r}")
    near = difflib.get_close_matches(name, OP_SPECS, n=1)
    hint = f"did you mean ops.{near[0]}? " if near else ""
    raise UnknownOpError(f"ops.{name} ({user_source()}): no such op; {hint}ops: {', '.join(sorted(OP_SPECS))}")


__all__ = ["OP_SPECS", "UnknownOpError", "advantage", "dataset", "generate", "reward", "sync_weights", "train_step"]
