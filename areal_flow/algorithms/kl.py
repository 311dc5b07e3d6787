"""Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman 2020, blog
"Approximating KL divergence").

With ``x ~ pi`` and ``log r = log pi_ref(x) - log pi(x)``:

- k1 = -log r                 unbiased, high variance, can be negative;
- k2 = (log r)^2 / 2          biased, low variance, >= 0;
- k3 = (r - 1) - log r        unbiased, low variance, >= 0 ("low_var_kl" in verl).

Used in the loss (``LossConfig.kl_in_reward=False``) or folded into the token reward
(``advantages.token_rewards``), and for the KL(behavior || current) metric.
"""

from __future__ import annotations

import torch

from areal_flow.algorithms.config import KL_ESTIMATOR_NAMES


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k3",
    *,
    loss_mask: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate for tokens sampled from ``pi``.

    Args:
        logprobs: ``[batch, seq]`` float, log pi(token) of the sampling policy, natural log.
        ref_logprobs: ``[batch, seq]`` float, log pi_ref(token) of the same tokens.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (see module doc).
        loss_mask: ``[batch, seq]``, 1 on valid tokens; other positions return 0 (so
            NaN/inf at padding never leaks out). None = every position valid.
        log_ratio_clamp: ``log r`` is clamped to ``[-c, c]`` before use (guard: ``exp``
            of k3 stays finite; ``exp(20)`` ~ 4.9e8).

    Returns:
        ``[batch, seq]`` float32, nats per token.

    Raises:
        ValueError: unknown estimator or mismatched shapes.
    """
    if estimator not in KL_ESTIMATOR_NAMES:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATOR_NAMES}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"kl_penalty: logprobs {tuple(logprobs.shape)} vs ref_logprobs {tuple(ref_logprobs.shape)}")
    log_r = (ref_logprobs.float() - logprobs.float()).clamp(-log_ratio_clamp, log_ratio_clamp)
    if loss_mask is not None:
        log_r = torch.where(loss_mask.bool(), log_r, torch.zeros_like(log_r))
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r.square()
    else:
        # expm1 keeps (r - 1) accurate when r is close to 1.
        kl = torch.expm1(log_r) - log_r
    if loss_mask is not None:
        kl = torch.where(loss_mask.bool(), kl, torch.zeros_like(kl))
    return kl
