"""The node kinds of areal-flow graphs, one module each, and their registry.

Each module declares its op (``OP``: port schema, compiler role, grain, executor) in
``areal_flow.ops.registry`` and the function that records its node while a ``@flow`` is
traced. A user adds a node kind from a graph file with :func:`register_op`.
"""

from areal_flow.ops import advantage as _advantage  # noqa: F401  (each module registers its op)
from areal_flow.ops import dataset as _dataset  # noqa: F401
from areal_flow.ops import filter as _filter  # noqa: F401
from areal_flow.ops import generate as _generate  # noqa: F401
from areal_flow.ops import logprobs as _logprobs  # noqa: F401
from areal_flow.ops import reward as _reward  # noqa: F401
from areal_flow.ops import sync_weights as _sync_weights  # noqa: F401
from areal_flow.ops import train_step as _train_step  # noqa: F401
from areal_flow.ops.advantage import advantage
from areal_flow.ops.dataset import dataset
from areal_flow.ops.filter import filter  # noqa: A004
from areal_flow.ops.generate import generate
from areal_flow.ops.logprobs import logprobs
from areal_flow.ops.registry import OPS, register_op
from areal_flow.ops.reward import reward
from areal_flow.ops.sync_weights import sync_weights
from areal_flow.ops.train_step import train_step

__all__ = ["OPS", "advantage", "dataset", "filter", "generate", "logprobs", "register_op", "reward", "sync_weights",
           "train_step"]
