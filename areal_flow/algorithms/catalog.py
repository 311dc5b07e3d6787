"""The algorithms' and advantage estimators' names and metadata, without their code.

Owns what tracing and graph validation need to know about ``areal_flow.algorithms``:
which algorithms and estimators exist, which algorithm needs a critic or folds the KL
to a reference policy into the reward, and which estimator reads critic values, gives
value targets (returns) or takes a per-token KL. It must import nothing heavy: the
registry and the estimators import torch, and tracing a graph must not.

The tables mirror ``builtin.py`` (via ``registry``) and ``advantages.ESTIMATORS``;
``tests/test_catalog.py`` checks them against the real code so they cannot drift. An
algorithm a user registers (``@register_algorithm`` in a graph file) is read from the
registry itself: registering one imports the registry, so it is loaded exactly when
such algorithms can exist.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class AlgorithmInfo:
    """What a graph needs to know about one registered algorithm.

    Attributes:
        name: registry name (``train_step(algorithm=...)``).
        default_estimator: the estimator it is designed with (a key of ``ESTIMATORS``).
        requires_critic: the update needs a critic's values and returns (PPO).
        kl_in_reward: its loss defaults fold the KL to a reference policy into the
            token reward (REINFORCE++): the advantage node needs ``ref=`` and an
            estimator that takes the KL.
    """

    name: str
    default_estimator: str
    requires_critic: bool = False
    kl_in_reward: bool = False


@dataclass(frozen=True)
class EstimatorInfo:
    """What a graph needs to know about one advantage estimator.

    Attributes:
        name: key of ``advantages.ESTIMATORS`` (``advantage(estimator=...)``).
        needs_values: reads critic values ``V(s_t)`` (GAE): needs ``critic=``.
        gives_returns: returns value targets, so a critic can be trained on them.
        takes_kl: folds a per-token KL (from ``ref=``) into the token reward.
        knobs: the keyword arguments a graph may pass it through ``ops.advantage(...,
            **knobs)`` (its parameters with defaults that the advantage executor does not
            fill itself: not ``kl``, ``kl_coef`` or ``group_ids``).
    """

    name: str
    needs_values: bool = False
    gives_returns: bool = False
    takes_kl: bool = False
    knobs: tuple[str, ...] = ()


ALGORITHMS: dict[str, AlgorithmInfo] = {
    a.name: a
    for a in (
        AlgorithmInfo("ppo", "gae", requires_critic=True),
        AlgorithmInfo("grpo", "grpo"),
        AlgorithmInfo("dr_grpo", "dr_grpo"),
        AlgorithmInfo("dapo", "grpo"),
        AlgorithmInfo("rloo", "rloo"),
        AlgorithmInfo("reinforce_pp", "reinforce_pp", kl_in_reward=True),
        AlgorithmInfo("gspo", "grpo"),
        AlgorithmInfo("sapo", "grpo"),
        AlgorithmInfo("m2po", "grpo"),
        AlgorithmInfo("lite_ppo", "lite_ppo"),
        AlgorithmInfo("decoupled_ppo", "grpo"),
    )
}

ESTIMATORS: dict[str, EstimatorInfo] = {
    e.name: e
    for e in (
        EstimatorInfo("gae", needs_values=True, gives_returns=True, knobs=("gamma", "lam")),
        EstimatorInfo("grpo", knobs=("eps", "std_unbiased")),
        EstimatorInfo("dr_grpo"),
        EstimatorInfo("rloo"),
        EstimatorInfo("reinforce_pp", gives_returns=True, takes_kl=True, knobs=("gamma", "eps")),
        EstimatorInfo("reinforce_pp_baseline", gives_returns=True, takes_kl=True, knobs=("gamma", "eps")),
        EstimatorInfo("lite_ppo", knobs=("eps", "std_unbiased")),
        EstimatorInfo("multi_turn", gives_returns=True, knobs=("gamma", "mode", "baseline")),
    )
}


def info_of(cls: type) -> AlgorithmInfo:
    """The metadata of a registered ``BaseAlgorithm`` subclass, read from its class attributes."""
    return AlgorithmInfo(
        cls.name, cls.default_estimator, cls.requires_critic, bool(cls.loss_defaults.get("kl_in_reward", False))
    )


def _registry():
    """The registry module if something imported it (then user algorithms may exist), else None."""
    return sys.modules.get("areal_flow.algorithms.registry")


def algorithm_info(name: str) -> AlgorithmInfo | None:
    """The metadata of algorithm ``name``, built-in or user-registered; None if unknown."""
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    registry = _registry()
    if registry is None or name not in registry.registered_algorithms():
        return None
    return info_of(registry.get_algorithm(name))


def algorithm_names() -> list[str]:
    """Sorted names of every known algorithm: the built-ins and any user-registered ones."""
    registry = _registry()
    return sorted(set(ALGORITHMS) | set(registry.registered_algorithms() if registry else ()))
