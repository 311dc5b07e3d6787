"""The node kinds of areal-flow graphs, one module each.

``OP_SPECS`` maps an op name to its port schema; the functions below record nodes
while a ``@flow`` is being traced.
"""

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

__all__ = ["OP_SPECS", "advantage", "dataset", "generate", "reward", "sync_weights", "train_step"]
