"""RL math: advantage estimators, policy/value losses, loss aggregation, algorithms.

Build an algorithm by name::

    from areal_flow.algorithms import build_algorithm, compute_advantages
    algo = build_algorithm("grpo", model, optimizer, micro_batch_size=4, max_grad_norm=1.0)
    adv = compute_advantages(algo.default_estimator, rewards=r, group_ids=g, loss_mask=m)
    metrics = algo.update_parameters({... , "advantages": adv.advantages})

Importing this package imports no torch: the names below load their module on first
use (PEP 562), so tracing a graph (``areal_flow.config`` reads ``algorithms.config``)
stays light. The registry module registers exactly the built-in algorithms
(``builtin.py``) when it is first imported; tracing reads their names and metadata from
the torch-free ``catalog.py``.
"""

from areal_flow.lazy import lazy_getattr

_EXPORTS = {
    "ESTIMATORS": "areal_flow.algorithms.advantages",
    "AdvantageOutput": "areal_flow.algorithms.advantages",
    "compute_advantages": "areal_flow.algorithms.advantages",
    "aggregate_loss": "areal_flow.algorithms.aggregation",
    "step_normalisers": "areal_flow.algorithms.aggregation",
    "BaseAlgorithm": "areal_flow.algorithms.base",
    "LossConfig": "areal_flow.algorithms.config",
    "kl_penalty": "areal_flow.algorithms.kl",
    "build_algorithm": "areal_flow.algorithms.lookup",
    "get_algorithm": "areal_flow.algorithms.lookup",
    "register_algorithm": "areal_flow.algorithms.registry",
    "registered_algorithms": "areal_flow.algorithms.lookup",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr("areal_flow.algorithms", _EXPORTS)
