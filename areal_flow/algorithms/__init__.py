"""RL math: advantage estimators, policy/value losses, loss aggregation, algorithms.

Build an algorithm by name::

    from areal_flow.algorithms import build_algorithm, compute_advantages
    algo = build_algorithm("grpo", model, optimizer, micro_batch_size=4, max_grad_norm=1.0)
    adv = compute_advantages(algo.default_estimator, rewards=r, group_ids=g, loss_mask=m)
    metrics = algo.update_parameters({... , "advantages": adv.advantages})

Importing this package registers exactly the built-in algorithms (``builtin.py``).
"""

from areal_flow.algorithms import builtin  # noqa: F401  (registers the built-in algorithms)
from areal_flow.algorithms.advantages import ESTIMATORS, AdvantageOutput, compute_advantages
from areal_flow.algorithms.aggregation import aggregate_loss, step_normalisers
from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.config import AdvantageConfig, LossConfig
from areal_flow.algorithms.kl import kl_penalty
from areal_flow.algorithms.registry import build_algorithm, get_algorithm, register_algorithm, registered_algorithms

__all__ = [
    "ESTIMATORS",
    "AdvantageConfig",
    "AdvantageOutput",
    "BaseAlgorithm",
    "LossConfig",
    "aggregate_loss",
    "build_algorithm",
    "compute_advantages",
    "get_algorithm",
    "kl_penalty",
    "register_algorithm",
    "registered_algorithms",
    "step_normalisers",
]
