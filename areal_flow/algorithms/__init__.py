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

from importlib import import_module

_EXPORTS = {
    "ESTIMATORS": "advantages",
    "AdvantageOutput": "advantages",
    "compute_advantages": "advantages",
    "aggregate_loss": "aggregation",
    "step_normalisers": "aggregation",
    "BaseAlgorithm": "base",
    "AdvantageConfig": "config",
    "LossConfig": "config",
    "kl_penalty": "kl",
    "build_algorithm": "lookup",
    "get_algorithm": "lookup",
    "register_algorithm": "registry",
    "registered_algorithms": "lookup",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Load the submodule that defines ``name``. Raises AttributeError for other names."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'areal_flow.algorithms' has no attribute {name!r}")
    return getattr(import_module(f"areal_flow.algorithms.{module}"), name)
