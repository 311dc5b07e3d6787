"""Typed configuration of the RL losses and of the advantage estimators.

Defaults are the GRPO setting common to AReaL and verl: token-level PPO clip at 0.2,
token-mean aggregation, no KL, no entropy bonus. Each registered algorithm starts
from these and overrides a few fields (``BaseAlgorithm.loss_defaults``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

POLICY_LOSSES = ("ppo", "gspo", "sapo", "m2po")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3")
BEHAVIOR_IMP_WEIGHT_MODES = ("mask", "truncate")


@dataclass
class LossConfig:
    """Everything that decides the training loss of one optimizer step.

    Raises ``ValueError`` (naming the field) on construction when a value is out of range.
    """

    policy_loss: str = "ppo"  # one of POLICY_LOSSES: "ppo" (token clip), "gspo", "sapo", "m2po".
    clip_eps_low: float = 0.2  # PPO/DAPO lower clip: ratio floor is 1 - clip_eps_low.
    clip_eps_high: float = 0.2  # PPO/DAPO upper clip: ratio ceiling is 1 + clip_eps_high (DAPO: 0.28).
    dual_clip_c: float | None = None  # dual-clip bound c > 1 on the loss of negative advantages; None = off.
    loss_agg_mode: str = "token-mean"  # one of LOSS_AGG_MODES; how per-token losses become one scalar.
    loss_agg_norm_length: int | None = None  # Dr.GRPO constant length (tokens); None = longest response of the step.
    kl_coef: float = 0.0  # weight of KL(policy || reference); 0 = no reference model needed.
    kl_estimator: str = "k3"  # one of KL_ESTIMATOR_NAMES (Schulman 2020); k3 = low-variance, non-negative.
    kl_in_reward: bool = False  # True: KL is folded into the token reward by the caller, not added to the loss.
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss); 0 = off.
    mask_truncated: bool = False  # DAPO overlong filtering: responses cut at max_new_tokens get no loss.
    use_decoupled_loss: bool = False  # AReaL decoupled PPO: clip against the proximal policy.
    behavior_imp_weight_cap: float | None = 5.0  # cap on pi_prox / pi_behav (decoupled only); None = uncapped.
    behavior_imp_weight_mode: str = "mask"  # "mask": drop tokens above the cap (AReaL); "truncate": min(w, cap).
    gspo_clip_eps_low: float = 3e-4  # GSPO lower clip on the length-normalised sequence ratio (paper: 3e-4).
    gspo_clip_eps_high: float = 4e-4  # GSPO upper clip on the sequence ratio (paper: 4e-4).
    sapo_tau_pos: float = 1.0  # SAPO gate temperature for positive advantages (paper: 1.0).
    sapo_tau_neg: float = 1.05  # SAPO gate temperature for non-positive advantages (paper: 1.05).
    m2po_threshold: float = 0.04  # M2PO bound on the mean squared log ratio of the kept tokens.
    value_clip_eps: float | None = 0.2  # critic: new values kept within old +- value_clip_eps; None = no clip.
    log_ratio_clamp: float = 20.0  # |log ratio| is clamped here before exp (exp(20) ~ 4.9e8): overflow guard.

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"LossConfig.{name}={getattr(self, name)!r}: {why}")

        if self.policy_loss not in POLICY_LOSSES:
            raise bad("policy_loss", f"must be one of {POLICY_LOSSES}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise bad("loss_agg_mode", f"must be one of {LOSS_AGG_MODES}")
        if self.kl_estimator not in KL_ESTIMATOR_NAMES:
            raise bad("kl_estimator", f"must be one of {KL_ESTIMATOR_NAMES}")
        if self.behavior_imp_weight_mode not in BEHAVIOR_IMP_WEIGHT_MODES:
            raise bad("behavior_imp_weight_mode", f"must be one of {BEHAVIOR_IMP_WEIGHT_MODES}")
        for name in ("clip_eps_low", "clip_eps_high", "gspo_clip_eps_low", "gspo_clip_eps_high"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise bad(name, "must be in [0, 1)")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise bad("dual_clip_c", "must be > 1 (or None to turn dual-clip off)")
        if self.behavior_imp_weight_cap is not None and self.behavior_imp_weight_cap <= 0:
            raise bad("behavior_imp_weight_cap", "must be > 0 (or None for no cap)")
        if self.loss_agg_norm_length is not None and self.loss_agg_norm_length <= 0:
            raise bad("loss_agg_norm_length", "must be a positive token count (or None)")
        for name in ("kl_coef", "entropy_coef", "m2po_threshold", "log_ratio_clamp"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be > 0")
        if self.value_clip_eps is not None and self.value_clip_eps <= 0:
            raise bad("value_clip_eps", "must be > 0 (or None for no clip)")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of all fields, for validating user overrides."""
        return tuple(f.name for f in fields(cls))


def merged_loss_config(defaults: dict[str, Any], overrides: dict[str, Any]) -> LossConfig:
    """``LossConfig`` from an algorithm's ``defaults``, then ``overrides`` (both field -> value).

    Raises:
        ValueError: a key that is not a ``LossConfig`` field (the valid ones listed), or a
            value out of range (naming the field).
    """
    unknown = sorted(set(overrides) - set(LossConfig.field_names()))
    if unknown:
        raise ValueError(f"unknown loss config key(s) {unknown}; valid: {sorted(LossConfig.field_names())}")
    return LossConfig(**{**defaults, **overrides})
