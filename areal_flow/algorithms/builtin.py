"""The algorithms shipped with areal-flow, registered by name.

Each is ``BaseAlgorithm`` with defaults: the policy loss, the ``LossConfig`` overrides
and ``default_estimator`` (the advantage estimator the trainer runs for it, a key of
``advantages.ESTIMATORS``). Anything not listed keeps the ``LossConfig`` default
(token-mean aggregation, PPO clip 0.2, no KL, no entropy bonus).
"""

from __future__ import annotations

from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.registry import register_algorithm


@register_algorithm("ppo")
class PPO(BaseAlgorithm):
    """PPO with a critic (Schulman et al. 2017): GAE advantages (Schulman et al. 2016),
    clipped surrogate, clipped value loss. Needs ``critic`` + ``critic_optimizer`` and
    ``values``/``returns`` in the batch."""

    default_estimator = "gae"
    policy_loss = "ppo"
    requires_critic = True


@register_algorithm("grpo")
class GRPO(BaseAlgorithm):
    """GRPO (Shao et al. 2024): group mean/std advantages, PPO clip, token-mean loss."""

    default_estimator = "grpo"
    policy_loss = "ppo"


@register_algorithm("dr_grpo")
class DrGRPO(BaseAlgorithm):
    """Dr.GRPO (Liu et al. 2025): group mean only, constant-length normalisation
    (set ``loss_agg_norm_length`` to the generation budget for the paper's constant)."""

    default_estimator = "dr_grpo"
    policy_loss = "ppo"
    loss_defaults = {"loss_agg_mode": "seq-mean-token-sum-norm"}


@register_algorithm("dapo")
class DAPO(BaseAlgorithm):
    """DAPO (Yu et al. 2025): clip-higher (0.2 / 0.28), token-mean loss, GRPO advantages.
    Dynamic sampling and overlong shaping are data-side: ``dapo.fill_dynamic_batch``,
    ``dapo.informative_groups``, ``dapo.overlong_penalty``."""

    default_estimator = "grpo"
    policy_loss = "ppo"
    loss_defaults = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "loss_agg_mode": "token-mean"}


@register_algorithm("rloo")
class RLOO(BaseAlgorithm):
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline, PPO clip."""

    default_estimator = "rloo"
    policy_loss = "ppo"


@register_algorithm("reinforce_pp")
class ReinforcePP(BaseAlgorithm):
    """REINFORCE++ (Hu 2025): batch-normalised returns with the KL in the reward (k1, as
    the paper); the trainer folds it in via ``compute_advantages("reinforce_pp", kl=...,
    kl_coef=loss_cfg.kl_coef)``. Use estimator ``reinforce_pp_baseline`` for the group
    baseline variant."""

    default_estimator = "reinforce_pp"
    policy_loss = "ppo"
    loss_defaults = {"kl_in_reward": True, "kl_estimator": "k1"}


@register_algorithm("gspo")
class GSPO(BaseAlgorithm):
    """GSPO (Zheng et al. 2025): sequence-level length-normalised ratio, clip 3e-4/4e-4,
    sequence-mean aggregation."""

    default_estimator = "grpo"
    policy_loss = "gspo"
    loss_defaults = {"policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"}


@register_algorithm("sapo")
class SAPO(BaseAlgorithm):
    """SAPO (Gao et al. 2025): soft sigmoid gate (tau 1.0 / 1.05) instead of the clip."""

    default_estimator = "grpo"
    policy_loss = "sapo"
    loss_defaults = {"policy_loss": "sapo"}


@register_algorithm("m2po")
class M2PO(BaseAlgorithm):
    """M2PO (Zheng et al. 2025): second-moment token mask (threshold 0.04), no clip."""

    default_estimator = "grpo"
    policy_loss = "m2po"
    loss_defaults = {"policy_loss": "m2po"}


@register_algorithm("lite_ppo")
class LitePPO(BaseAlgorithm):
    """LitePPO (Liu et al. 2025, "Tricks or Traps"): group mean / batch std, token-mean."""

    default_estimator = "lite_ppo"
    policy_loss = "ppo"
    loss_defaults = {"loss_agg_mode": "token-mean"}


@register_algorithm("decoupled_ppo")
class DecoupledPPO(BaseAlgorithm):
    """Decoupled PPO (Fu et al. 2025, AReaL eq. 5) for stale samples: clip against the
    recomputed proximal policy, behavior importance weight capped at 5 (tokens above
    are masked; ``behavior_imp_weight_mode="truncate"`` to truncate instead)."""

    default_estimator = "grpo"
    policy_loss = "ppo"
    loss_defaults = {"use_decoupled_loss": True}
