"""The algorithms and advantage estimators: the one table of the built-in algorithms, the
estimators' metadata, and the lookups tracing and compiling use, all without torch.

Owns ``ALGORITHMS``, the single definition of every built-in algorithm (its default
estimator, policy loss, ``LossConfig`` defaults, critic); ``builtin.py`` turns each row into
the registered ``BaseAlgorithm`` subclass, so nothing is written twice. It also owns the
estimators' metadata (``ESTIMATORS``, checked against the functions of ``advantages.py``
by ``tests/test_catalog.py``) and :func:`register_estimator`, with which a graph file adds
an estimator (its metadata is read from its signature). It must import nothing heavy:
the registry and the estimators import torch, and tracing a graph must not. An algorithm
a user registers (``@register_algorithm`` in a graph file) is read from the registry
itself: registering one imports the registry, so it is loaded exactly when such
algorithms can exist.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from areal_flow.algorithms.config import LossConfig, merged_loss_config


@dataclass(frozen=True)
class AlgorithmInfo:
    """What the tracer, the compiler and ``builtin.py`` know about one algorithm.

    Attributes:
        name: registry name (``train_step(algorithm=...)``).
        default_estimator: the estimator it is designed with (an estimator name); an
            ``ops.advantage`` that names no estimator gets it.
        policy_loss: the ``LossConfig.policy_loss`` it requires (None: any).
        loss_defaults: its ``LossConfig`` fields that differ from the dataclass defaults.
        requires_critic: the update needs a critic's values and returns (PPO).
        doc: what it is, with its paper (the class docstring).
    """

    name: str
    default_estimator: str
    policy_loss: str | None = "ppo"
    loss_defaults: dict[str, Any] = field(default_factory=dict)
    requires_critic: bool = False
    doc: str = field(default="", compare=False)

    @property
    def kl_in_reward(self) -> bool:
        """Its loss defaults fold the KL to a reference policy into the token reward
        (REINFORCE++): the advantage node needs ``ref=`` and an estimator that takes the KL."""
        return bool(self.loss_defaults.get("kl_in_reward", False))

    def loss_config(self, overrides: dict[str, Any]) -> LossConfig:
        """This algorithm's ``LossConfig``: its defaults, then ``overrides`` (``train.loss``).

        Raises:
            ValueError: an unknown field, a value out of range (both named), or a
                ``policy_loss`` other than the one this algorithm requires.
        """
        cfg = merged_loss_config(self.loss_defaults, overrides)
        if self.policy_loss is not None and cfg.policy_loss != self.policy_loss:
            raise ValueError(f"algorithm '{self.name}' uses policy_loss='{self.policy_loss}', "
                             f"not '{cfg.policy_loss}'")
        return cfg


ALGORITHMS: dict[str, AlgorithmInfo] = {a.name: a for a in (
    AlgorithmInfo("ppo", "gae", requires_critic=True, doc=(
        "PPO with a critic (Schulman et al. 2017): GAE advantages (Schulman et al. 2016), clipped surrogate, "
        "clipped value loss. The critic is trained in its own train_step on the advantage node's returns.")),
    AlgorithmInfo("grpo", "grpo", doc="GRPO (Shao et al. 2024): group mean/std advantages, PPO clip, token-mean loss."),
    AlgorithmInfo("dr_grpo", "dr_grpo", loss_defaults={"loss_agg_mode": "seq-mean-token-sum-norm"}, doc=(
        "Dr.GRPO (Liu et al. 2025): group mean only, constant-length normalisation (set loss_agg_norm_length "
        "to the generation budget for the paper's constant).")),
    AlgorithmInfo("dapo", "grpo", loss_defaults={"clip_eps_low": 0.2, "clip_eps_high": 0.28,
                                                 "loss_agg_mode": "token-mean"}, doc=(
        "DAPO (Yu et al. 2025): clip-higher (0.2 / 0.28), token-mean loss, GRPO advantages. Dynamic sampling "
        "and overlong shaping are data-side: dapo.fill_dynamic_batch, dapo.informative_groups, "
        "dapo.overlong_penalty.")),
    AlgorithmInfo("rloo", "rloo", doc="RLOO (Ahmadian et al. 2024): leave-one-out baseline, PPO clip."),
    AlgorithmInfo("reinforce_pp", "reinforce_pp", loss_defaults={"kl_in_reward": True, "kl_estimator": "k1"}, doc=(
        "REINFORCE++ (Hu 2025): batch-normalised returns with the KL in the reward (k1, as the paper); the "
        "advantage node folds it in with the train_step's kl_coef. Estimator reinforce_pp_baseline is the "
        "group baseline variant.")),
    AlgorithmInfo("gspo", "grpo", policy_loss="gspo", loss_defaults={"policy_loss": "gspo",
                                                                     "loss_agg_mode": "seq-mean-token-mean"}, doc=(
        "GSPO (Zheng et al. 2025): sequence-level length-normalised ratio, clip 3e-4/4e-4, sequence-mean "
        "aggregation.")),
    AlgorithmInfo("sapo", "grpo", policy_loss="sapo", loss_defaults={"policy_loss": "sapo"}, doc=(
        "SAPO (Gao et al. 2025): soft sigmoid gate (tau 1.0 / 1.05) instead of the clip.")),
    AlgorithmInfo("m2po", "grpo", policy_loss="m2po", loss_defaults={"policy_loss": "m2po"}, doc=(
        "M2PO (Zheng et al. 2025): second-moment token mask (threshold 0.04), no clip.")),
    AlgorithmInfo("lite_ppo", "lite_ppo", loss_defaults={"loss_agg_mode": "token-mean"}, doc=(
        "LitePPO (Liu et al. 2025, 'Tricks or Traps'): group mean / batch std, token-mean.")),
    AlgorithmInfo("decoupled_ppo", "grpo", loss_defaults={"use_decoupled_loss": True}, doc=(
        "Decoupled PPO (Fu et al. 2025, AReaL eq. 5) for stale samples: clip against the proximal policy "
        "(the weights before the update), behavior importance weight capped at 5 (tokens above are masked; "
        "behavior_imp_weight_mode='truncate' to truncate instead). The compiler turns the decoupled loss on "
        "for every PPO-clip algorithm whose samples may be stale (k >= 1); this name keeps it on at k = 0.")),
)}
"""Every built-in algorithm; ``builtin.py`` registers one ``BaseAlgorithm`` subclass per row."""


@dataclass(frozen=True)
class EstimatorInfo:
    """What a graph needs to know about one advantage estimator.

    Attributes:
        name: ``advantage(estimator=...)``.
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


ESTIMATORS: dict[str, EstimatorInfo] = {e.name: e for e in (
    EstimatorInfo("gae", needs_values=True, gives_returns=True, knobs=("gamma", "lam")),
    EstimatorInfo("grpo", knobs=("eps", "std_unbiased")),
    EstimatorInfo("dr_grpo"),
    EstimatorInfo("rloo"),
    EstimatorInfo("reinforce_pp", gives_returns=True, takes_kl=True, knobs=("gamma", "eps")),
    EstimatorInfo("reinforce_pp_baseline", gives_returns=True, takes_kl=True, knobs=("gamma", "eps")),
    EstimatorInfo("lite_ppo", knobs=("eps", "std_unbiased")),
    EstimatorInfo("multi_turn", gives_returns=True, knobs=("gamma", "mode", "baseline")),
)}
"""The built-in estimators (the functions are ``advantages.ESTIMATORS``, same keys)."""

FILLED_BY_EXECUTOR = ("kl", "kl_coef", "group_ids")
"""Estimator parameters with defaults that the advantage executor passes itself (not knobs)."""


@dataclass(frozen=True)
class UserEstimator:
    """An estimator a graph file registered: its metadata and its function (``fn(**inputs)
    -> advantages.AdvantageOutput``, see :func:`register_estimator`)."""

    info: EstimatorInfo
    fn: Callable[..., Any]


_USER_ESTIMATORS: dict[str, UserEstimator] = {}


def estimator_info_of(name: str, fn: Callable[..., Any], gives_returns: bool) -> EstimatorInfo:
    """The metadata of estimator function ``fn``, read from its signature: ``values`` ->
    needs a critic, ``kl`` -> takes the KL, knobs = its other keyword defaults."""
    params = inspect.signature(fn).parameters
    knobs = tuple(p for p, v in params.items() if v.default is not inspect.Parameter.empty
                  and p not in FILLED_BY_EXECUTOR)
    return EstimatorInfo(name, needs_values="values" in params, gives_returns=gives_returns,
                         takes_kl="kl" in params, knobs=knobs)


def register_estimator(name: str, *, gives_returns: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: add an advantage estimator a graph can name (``ops.advantage(estimator=name)``).

    The function takes what it needs of ``rewards [batch]``, ``group_ids [batch]`` int,
    ``loss_mask [batch, seq]``, ``values [batch, seq]`` (a critic's), ``kl [batch, seq]``
    and ``kl_coef`` (a reference's), ``turn_rewards`` / ``turn_ids`` (episodes), plus keyword
    knobs with defaults, and returns ``advantages.AdvantageOutput`` (``advantages [batch, seq]``
    float32, 0 off the mask; ``returns`` when ``gives_returns``). Its definition travels in
    the plan (``plan.estimators``), so workers need not import the graph file.

    Raises:
        ValueError: an empty name or a built-in estimator's name.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"estimator name must be a non-empty string, got {name!r}")
    if name in ESTIMATORS:
        raise ValueError(f"estimator '{name}' is built in; register yours under another name")

    def deco(fn: Callable) -> Callable:
        _USER_ESTIMATORS[name] = UserEstimator(estimator_info_of(name, fn, gives_returns), fn)
        return fn

    return deco


def user_estimator(name: str) -> UserEstimator | None:
    """The user-registered estimator ``name`` (None if there is none)."""
    return _USER_ESTIMATORS.get(name)


def add_user_estimator(name: str, estimator: UserEstimator) -> None:
    """Register ``estimator`` (a plan carries it by value) under ``name``."""
    _USER_ESTIMATORS[name] = estimator


def estimator_info(name: str) -> EstimatorInfo | None:
    """The metadata of estimator ``name``, built-in or user-registered; None if unknown."""
    if name in ESTIMATORS:
        return ESTIMATORS[name]
    user = _USER_ESTIMATORS.get(name)
    return None if user is None else user.info


def estimator_names() -> list[str]:
    """Every known estimator: the built-ins in table order, then the user-registered ones."""
    return list(ESTIMATORS) + sorted(set(_USER_ESTIMATORS) - set(ESTIMATORS))


def info_of(cls: type) -> AlgorithmInfo:
    """The metadata of a registered ``BaseAlgorithm`` subclass, read from its class attributes."""
    return AlgorithmInfo(cls.name, cls.default_estimator, cls.policy_loss, dict(cls.loss_defaults),
                         cls.requires_critic, doc=" ".join((cls.__doc__ or "").split()))


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


def user_algorithm(name: str) -> type | None:
    """The class of a user-registered (not built-in) algorithm ``name``; None otherwise."""
    registry = _registry()
    if name in ALGORITHMS or registry is None or name not in registry.registered_algorithms():
        return None
    return registry.get_algorithm(name)


def algorithm_names() -> list[str]:
    """Sorted names of every known algorithm: the built-ins and any user-registered ones."""
    registry = _registry()
    return sorted(set(ALGORITHMS) | set(registry.registered_algorithms() if registry else ()))


def algorithms_defaulting_to(estimator: str) -> list[str]:
    """The known algorithms whose default estimator is ``estimator`` (sorted)."""
    return [n for n in algorithm_names() if algorithm_info(n).default_estimator == estimator]
