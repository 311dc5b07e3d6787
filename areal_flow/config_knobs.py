"""The knobs graphs pass to their ops: the sections ``advantage``, ``replay`` and ``reward`` of
:class:`areal_flow.config.ExperimentConfig` (re-exported there), each with the checks of its own
values (``__post_init__``)."""

from __future__ import annotations

from dataclasses import dataclass

from areal_flow.config_keys import ConfigError


@dataclass
class AdvantageKnobs:
    """Estimator knobs that graphs pass to ``ops.advantage`` (each graph picks the ones
    its estimator takes, e.g. PPO's GAE: ``gamma=cfg.advantage.gamma, lam=cfg.advantage.lam``)."""

    gamma: float = 1.0
    """Discount per token (GAE, REINFORCE++), in [0, 1]."""
    lam: float = 1.0
    """GAE lambda (Schulman et al. 2016), in [0, 1]; 1 = Monte-Carlo returns minus V."""
    kl_coef: float = 0.0
    """beta of the KL to a reference folded into the reward by graphs that pass it (ops.advantage kl_coef)."""

    def __post_init__(self) -> None:
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"advantage.{key}={getattr(self, key)}: must be in [0, 1]")


@dataclass
class ReplayKnobs:
    """Knobs that graphs pass to ``ops.replay`` (experience replay, ``graphs/arith_grpo_replay.py``)."""

    ratio: float = 0.25
    """Share of each train step's rows drawn from earlier steps' (rows older than k versions are evicted), in [0, 1); the seed's range is 0.2-0.5."""
    capacity: int = 256
    """Rows the replay buffer keeps (the oldest leave first), >= 1."""

    def __post_init__(self) -> None:
        if not 0 <= self.ratio < 1:
            raise ConfigError(f"replay.ratio={self.ratio}: must be in [0, 1) (the replayed share of a step's rows)")
        if self.capacity < 1:
            raise ConfigError(f"replay.capacity={self.capacity}: must be >= 1 (rows the buffer keeps)")


@dataclass
class RewardKnobs:
    """Knobs of the reward node's data-side shaping and filtering (DAPO, Yu et al. 2025)."""

    max_attempts: int = 8
    """Dynamic sampling (``keep="informative"``): prompts tried per batch slot (the first
    + replacements) before the run stops with an error."""
    overlong_cache: int = 0
    """Soft overlong punishment window L_cache, tokens (DAPO eq. 13); 0 = off."""
    model_steps: int = 400
    """Reward model '<preset>-rm': optimizer steps of its training in code (cached)."""
    model_lr: float = 1e-3
    """Reward model '<preset>-rm': peak learning rate of its training."""
    timeout_s: float = 10.0
    """Seconds one rule-reward call may run; past it the sample counts as failed (its thread is abandoned)."""
    workers: int = 4
    """Threads calling a rule reward function (calls of a group in flight at once)."""
    max_failure_fraction: float = 0.5
    """The run stops when more than this fraction of the last failure_window samples' rewards failed
    (the generate node applies it to its requests too: empty responses and generation errors; a rollout
    node to its episodes: failed env or agent episodes)."""
    failure_window: int = 200
    """Samples in the sliding window of max_failure_fraction."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or self.workers < 1 or self.failure_window < 1:
            raise ConfigError(f"reward.timeout_s={self.timeout_s}, reward.workers={self.workers}, "
                              f"reward.failure_window={self.failure_window}: must be > 0, >= 1 and >= 1")
        if not 0 < self.max_failure_fraction <= 1:
            raise ConfigError(f"reward.max_failure_fraction={self.max_failure_fraction}: must be in (0, 1]")
        if self.max_attempts < 1:
            raise ConfigError(f"reward.max_attempts={self.max_attempts}: must be >= 1")
        if self.overlong_cache < 0:
            raise ConfigError(f"reward.overlong_cache={self.overlong_cache}: must be >= 0")
