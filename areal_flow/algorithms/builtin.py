"""The algorithms shipped with areal-flow, registered by name.

Each row of ``catalog.ALGORITHMS`` (the one definition: default estimator, policy loss,
``LossConfig`` defaults, critic, paper) becomes a ``BaseAlgorithm`` subclass registered under
its name; ``BUILTIN`` maps the names to those classes. Anything a row does not set keeps the
``LossConfig`` default (token-mean aggregation, PPO clip 0.2, no KL, no entropy bonus).
"""

from __future__ import annotations

from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.catalog import ALGORITHMS, AlgorithmInfo
from areal_flow.algorithms.registry import register_algorithm


def _algorithm_class(info: AlgorithmInfo) -> type[BaseAlgorithm]:
    """The registered ``BaseAlgorithm`` subclass of ``info`` (class name from the algorithm's, ``dr_grpo`` -> ``DrGrpo``)."""
    attrs = {"__doc__": info.doc, "__module__": __name__, "default_estimator": info.default_estimator,
             "policy_loss": info.policy_loss, "loss_defaults": dict(info.loss_defaults),
             "requires_critic": info.requires_critic}
    cls = type("".join(part.capitalize() for part in info.name.split("_")), (BaseAlgorithm,), attrs)
    return register_algorithm(info.name)(cls)


BUILTIN: dict[str, type[BaseAlgorithm]] = {name: _algorithm_class(info) for name, info in ALGORITHMS.items()}
"""Name -> the registered class of every built-in algorithm."""
