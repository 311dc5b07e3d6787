"""Per-token policy and value losses. Aggregation to a scalar is ``aggregation.py``.

Conventions for every function here:

- ``logprobs [batch, seq]`` float: log pi_theta(token) of the policy being trained
  (with grad), natural log, aligned with ``loss_mask`` (``token_logprobs`` layout).
- ``old_logprobs [batch, seq]``: the policy the ratio is taken against: the behavior
  policy (engine log-probs), or the proximal policy under decoupled PPO.
- ``advantages [batch, seq]``, ``loss_mask [batch, seq]`` (1 on response tokens).
- Returned per-token losses are float32 and exactly 0 where ``loss_mask`` is 0; invalid
  positions are *selected* away with ``torch.where``, so NaN/inf there never leaks in.
- Overflow guard: the log ratio is clamped to ``[-log_ratio_clamp, log_ratio_clamp]``
  before ``exp`` (default 20, ``exp(20)`` ~ 4.9e8), so the ratio is always finite; a
  token beyond the clamp gets no gradient from the ratio.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from areal_flow.algorithms.config import LossConfig


class PolicyLossOutput(NamedTuple):
    """Attributes:
    loss: ``[batch, seq]`` float32 per-token loss (to be minimised).
    clipped: ``[batch, seq]`` bool, valid tokens whose gradient a clip or mask removed.
    ratio: ``[batch, seq]`` float32 detached importance ratio pi_theta / pi_old.
    """

    loss: torch.Tensor
    clipped: torch.Tensor
    ratio: torch.Tensor


def _zero_invalid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype))


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, clamp: float) -> torch.Tensor:
    return _zero_invalid(logprobs.float() - old_logprobs.float(), mask).clamp(-clamp, clamp)


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float, dual_clip_c: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = -adv * ratio
    clipped_loss = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip_c is not None:
        bound = -adv * dual_clip_c
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        clipped = clipped | dual
    return loss, clipped


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), negated to a loss.

    ``L_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)`` with
    ``r_t = exp(logprobs - old_logprobs)``. Separate ``eps_low``/``eps_high`` is DAPO's
    clip-higher (Yu et al. 2025, §3.1). Dual-clip (Ye et al. 2020, "Mastering Complex
    Control in MOBA Games"): for ``A_t < 0`` the loss is further bounded by
    ``-c * A_t`` (c > 1), so a huge ratio on a negative advantage cannot blow up.
    """
    mask = loss_mask.bool()
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, mask, log_ratio_clamp))
    adv = _zero_invalid(advantages.float(), mask)
    loss, clipped = _clipped_surrogate(ratio, adv, clip_eps_low, clip_eps_high, dual_clip_c)
    return PolicyLossOutput(_zero_invalid(loss, mask), clipped & mask, ratio.detach())


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
    log_ratio_clamp: float = 20.0,
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5), token form.

    Sequence ratio ``s_i = exp(mean_t(logprobs - old_logprobs))`` over the valid tokens
    of row i (length-normalised). Per token (the paper's GSPO-token variant):
    ``s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]`` - equal in value to ``s_i``, with
    gradient ``s_i * grad log pi(y_t)``; then the PPO clip with the (tiny) GSPO ranges.
    With ``seq-mean-token-mean`` aggregation and one advantage per sequence this is
    exactly the sequence-level objective. An empty row has ratio 1 and loss 0.
    """
    mask = loss_mask.bool()
    lr = _zero_invalid(logprobs.float() - old_logprobs.float(), mask)
    seq_lr = lr.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    lp = logprobs.float()
    token_lr = (seq_lr.detach()[:, None] + lp - lp.detach()).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(_zero_invalid(token_lr, mask))
    adv = _zero_invalid(advantages.float(), mask)
    loss, clipped = _clipped_surrogate(ratio, adv, clip_eps_low, clip_eps_high, None)
    return PolicyLossOutput(_zero_invalid(loss, mask), clipped & mask, ratio.detach())


def sapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    log_ratio_clamp: float = 20.0,
) -> PolicyLossOutput:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347).

    Soft sigmoid gate instead of the hard clip:
    ``L_t = -(4 / tau) * sigmoid(tau * (r_t - 1)) * A_t`` with ``tau = tau_pos`` if
    ``A_t > 0`` else ``tau_neg``. At ``r_t = 1`` the gradient equals the plain policy
    gradient (``4 * sigmoid'(0) = 1``) and it decays smoothly as ``r_t`` leaves 1.
    Nothing is hard-clipped: ``clipped`` is all False.
    """
    mask = loss_mask.bool()
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, mask, log_ratio_clamp))
    adv = _zero_invalid(advantages.float(), mask)
    tau = torch.where(adv > 0, torch.tensor(tau_pos), torch.tensor(tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return PolicyLossOutput(_zero_invalid(-gate * adv, mask), torch.zeros_like(mask), ratio.detach())


def m2po_keep_mask(log_ratio: torch.Tensor, loss_mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO token mask (Zheng et al. 2025, "Prosperity before Collapse", arXiv:2510.01161).

    Masks the tokens with the largest squared log ratio ``(log pi_theta/pi_behav)^2``,
    largest first, until the mean of the kept tokens' squared log ratios (the second
    moment M2) is ``<= threshold``. Removing the largest value never raises the mean, so
    this is one sort and a suffix mean.

    Args:
        log_ratio: ``[batch, seq]`` detached log(pi_theta / pi_behav) at the step start.
        loss_mask: ``[batch, seq]``.
        threshold: tau_M2 (paper: 0.04).

    Returns:
        ``[batch, seq]`` bool, True on valid tokens that are kept.
    """
    mask = loss_mask.bool()
    sq = log_ratio.detach().double().square()[mask]
    n = sq.numel()
    if n == 0:
        return mask.clone()
    vals, order = torch.sort(sq, descending=True)
    suffix_sum = torch.flip(torch.cumsum(torch.flip(vals, [0]), 0), [0])
    suffix_mean = suffix_sum / torch.arange(n, 0, -1, dtype=torch.float64, device=suffix_sum.device)
    ok = (suffix_mean <= threshold).nonzero()
    n_drop = int(ok[0]) if ok.numel() else n
    keep_flat = torch.ones(n, dtype=torch.bool)
    keep_flat[order[:n_drop]] = False
    keep = torch.zeros_like(mask)
    keep[mask] = keep_flat
    return keep


def m2po_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    keep_mask: torch.Tensor,
    log_ratio_clamp: float = 20.0,
) -> PolicyLossOutput:
    """M2PO objective (arXiv:2510.01161): unclipped ``L_t = -M_t * r_t * A_t`` with the
    second-moment mask ``M_t = keep_mask`` (``m2po_keep_mask``). Masked tokens are
    reported as ``clipped``."""
    mask = loss_mask.bool()
    keep = keep_mask.bool() & mask
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, mask, log_ratio_clamp))
    loss = -_zero_invalid(advantages.float(), mask) * ratio
    return PolicyLossOutput(_zero_invalid(loss, keep), mask & ~keep, ratio.detach())


def behavior_importance_weight(
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    cap: float | None,
    mode: str = "mask",
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Behavior importance weight of decoupled PPO (Fu et al. 2025, AReaL, eq. 5).

    ``w_t = pi_prox(y_t) / pi_behav(y_t)``, a constant (no gradient) multiplying the
    per-token clipped loss taken against the proximal policy. The cap is an explicit
    choice (``LossConfig.behavior_imp_weight_cap`` / ``behavior_imp_weight_mode``):
    ``"mask"`` zeroes tokens with ``w_t > cap`` (AReaL's behaviour), ``"truncate"`` uses
    ``min(w_t, cap)`` (truncated importance sampling); ``cap=None`` applies ``w_t`` as is.

    Returns:
        ``(weight [batch, seq] float32, capped [batch, seq] bool)``: weight is 0 on
        invalid positions; ``capped`` marks valid tokens whose weight exceeded the cap.
    """
    mask = loss_mask.bool()
    w = torch.exp(_log_ratio(proximal_logprobs.detach(), behavior_logprobs.detach(), mask, log_ratio_clamp))
    if cap is None:
        return _zero_invalid(w, mask), torch.zeros_like(mask)
    capped = mask & (w > cap)
    if mode == "mask":
        w = torch.where(capped, torch.zeros_like(w), w)
    elif mode == "truncate":
        w = w.clamp(max=cap)
    else:
        raise ValueError(f"behavior_imp_weight_mode={mode!r}: must be 'mask' or 'truncate'")
    return _zero_invalid(w, mask), capped


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_eps: float | None = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped critic loss (PPO2 value clipping, OpenAI Baselines; analysed by
    Engstrom et al. 2020, "Implementation Matters", §3).

    ``L_t = 0.5 * max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -eps, eps) - R_t)^2)``;
    ``clip_eps=None`` gives ``0.5 * (V_t - R_t)^2``. All tensors ``[batch, seq]``;
    values in reward units.

    Returns:
        ``(loss [batch, seq] float32, clipped [batch, seq] bool)``: ``clipped`` where the clipped
        term is the larger and ``|V_t - V_old_t| > eps``.
    """
    mask = loss_mask.bool()
    v = values.float()
    target = _zero_invalid(returns.float(), mask)
    unclipped = (v - target).square()
    if clip_eps is None:
        return _zero_invalid(0.5 * unclipped, mask), torch.zeros_like(mask)
    old = _zero_invalid(old_values.float(), mask)
    v_clip = old + (v - old).clamp(-clip_eps, clip_eps)
    clipped_sq = (v_clip - target).square()
    # clipped: the clipped term wins and V left V_old +- eps. Inside that range the two terms are
    # equal in exact arithmetic, but old + (v - old) need not round back to v in fp32 (it does when
    # v and old are within a factor 2, Sterbenz), so the comparison alone would flag rounding ties.
    active = mask & ((v - old).abs() > clip_eps) & (clipped_sq > unclipped)
    return _zero_invalid(0.5 * torch.maximum(unclipped, clipped_sq), mask), active


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each next-token distribution: ``[..., vocab]`` logits (already
    divided by the temperature) -> ``[...]`` float32, ``H = logsumexp(z) - sum softmax(z) z``."""
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def compute_policy_loss(
    cfg: LossConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    m2po_keep: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Dispatch on ``cfg.policy_loss``. ``m2po_keep`` (``[batch, seq]`` bool) is required
    for ``"m2po"`` (``ValueError`` otherwise)."""
    common = dict(log_ratio_clamp=cfg.log_ratio_clamp)
    if cfg.policy_loss == "ppo":
        return ppo_clip_loss(
            logprobs, old_logprobs, advantages, loss_mask, clip_eps_low=cfg.clip_eps_low,
            clip_eps_high=cfg.clip_eps_high, dual_clip_c=cfg.dual_clip_c, **common,
        )
    if cfg.policy_loss == "gspo":
        return gspo_loss(
            logprobs, old_logprobs, advantages, loss_mask, clip_eps_low=cfg.gspo_clip_eps_low,
            clip_eps_high=cfg.gspo_clip_eps_high, **common,
        )
    if cfg.policy_loss == "sapo":
        return sapo_loss(
            logprobs, old_logprobs, advantages, loss_mask, tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg, **common
        )
    if m2po_keep is None:
        raise ValueError("policy_loss 'm2po' needs m2po_keep (from m2po_keep_mask)")
    return m2po_loss(logprobs, old_logprobs, advantages, loss_mask, keep_mask=m2po_keep, **common)
