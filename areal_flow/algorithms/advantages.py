"""Advantage estimators: pure functions from rewards (and values) to per-token advantages.

Common layout (see ``docs/DEVELOPING.md``): ``loss_mask [batch, seq]`` is 1 on response
tokens; an outcome reward ``rewards [batch]`` belongs to the whole response. Every
estimator returns an ``AdvantageOutput`` whose ``advantages`` is ``[batch, seq]``
float32 and exactly 0 where ``loss_mask`` is 0, so padding never carries a signal.

Numerical guards shared by the group estimators: statistics are taken in float64; a
group whose rewards are all equal (max == min) gets advantage exactly 0 (the centred
reward is set to 0 rather than computed, because e.g. ``0.1`` repeated does not cancel
exactly in float32); singleton groups have std 0 and advantage 0; ``eps`` is added to
every std before dividing. Non-finite rewards are rejected (``ValueError``).

Select an estimator by name with ``compute_advantages(name, **kwargs)``; the names are
the keys of ``ESTIMATORS``.
"""

from __future__ import annotations

import inspect
from typing import Callable, NamedTuple

import torch

from areal_flow.algorithms.catalog import estimator_names, user_estimator
from areal_flow.algorithms.returns import (
    AdvantageOutput,
    discounted_returns,
    gae,
    multi_turn,
    token_rewards,
    whiten,
)


def _check_outcome(name: str, rewards: torch.Tensor, loss_mask: torch.Tensor, group_ids: torch.Tensor | None) -> None:
    if loss_mask.dim() != 2:
        raise ValueError(f"{name}: loss_mask must be [batch, seq], got shape {tuple(loss_mask.shape)}")
    if rewards.dim() != 1 or rewards.shape[0] != loss_mask.shape[0]:
        raise ValueError(f"{name}: rewards must be [batch]={loss_mask.shape[0]}, got shape {tuple(rewards.shape)}")
    bad = (~torch.isfinite(rewards)).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"{name}: non-finite reward at batch index {bad.tolist()}")
    if group_ids is not None:
        if group_ids.shape != rewards.shape:
            raise ValueError(f"{name}: group_ids must be [batch]={rewards.shape[0]}, got {tuple(group_ids.shape)}")
        if group_ids.is_floating_point():
            raise ValueError(f"{name}: group_ids must be an integer tensor, got {group_ids.dtype}")


def _broadcast(score: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[batch]`` score -> ``[batch, seq]`` float32 on valid tokens, exact 0 elsewhere."""
    mask = loss_mask.bool()
    return torch.where(mask, score[:, None].expand_as(mask), torch.zeros((), dtype=score.dtype)).float()


class _GroupStats(NamedTuple):
    centered: torch.Tensor  # [batch] float64, r_i - mean_g(i); exactly 0 in constant groups
    index: torch.Tensor  # [batch] int64, dense group index of each sample
    count: torch.Tensor  # [n_groups] float64, group sizes
    sq_dev: torch.Tensor  # [n_groups] float64, sum of squared deviations in the group


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> _GroupStats:
    _, index = torch.unique(group_ids, return_inverse=True)
    n = int(index.max()) + 1 if index.numel() else 0
    r = rewards.double()
    count = torch.zeros(n, dtype=torch.float64).index_add_(0, index, torch.ones_like(r))
    mean = torch.zeros(n, dtype=torch.float64).index_add_(0, index, r) / count
    hi = torch.full((n,), -torch.inf, dtype=torch.float64).scatter_reduce(0, index, r, "amax")
    lo = torch.full((n,), torch.inf, dtype=torch.float64).scatter_reduce(0, index, r, "amin")
    constant = (hi == lo)[index]
    centered = torch.where(constant, torch.zeros_like(r), r - mean[index])
    sq_dev = torch.zeros(n, dtype=torch.float64).index_add_(0, index, centered.square())
    return _GroupStats(centered, index, count, sq_dev)


def _std(sq_dev: torch.Tensor, count: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """std from summed squared deviations; 0 where the divisor would be 0 (n=1 unbiased)."""
    dof = count - 1 if unbiased else count
    return torch.where(dof > 0, (sq_dev / dof.clamp(min=1)).sqrt(), torch.zeros_like(sq_dev))


def _safe_div(centered: torch.Tensor, std: torch.Tensor, eps: float) -> torch.Tensor:
    """``centered / (std + eps)``, and 0 where std is 0 (then centered is 0 too), so
    ``eps=0`` cannot produce 0/0 = NaN."""
    return torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))


def grpo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps: float = 1e-6,
    std_unbiased: bool = True,
) -> AdvantageOutput:
    """Group-relative advantage (GRPO; Shao et al. 2024, DeepSeekMath §4.1.2, outcome supervision).

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` for every response token of sample i,
    with mean and std over the samples sharing ``group_ids[i]`` (groups may differ in size).

    Args:
        rewards: ``[batch]`` float, outcome reward per sample.
        group_ids: ``[batch]`` int, prompt group of each sample.
        loss_mask: ``[batch, seq]``, 1 on response tokens.
        eps: added to the std (guard against division by ~0); where the std is exactly 0
            the advantage is 0 whatever ``eps`` is.
        std_unbiased: True = sample std (divide by n-1, ``torch.std`` default, as verl);
            False = population std (divide by n). Singleton groups: std 0, advantage 0.
    """
    _check_outcome("grpo", rewards, loss_mask, group_ids)
    st = _group_stats(rewards, group_ids)
    std = _std(st.sq_dev, st.count, std_unbiased)[st.index]
    return AdvantageOutput(_broadcast(_safe_div(st.centered, std, eps), loss_mask), None)


def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor, loss_mask: torch.Tensor) -> AdvantageOutput:
    """Dr.GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training", §3):
    ``A_i = r_i - mean_g(r)``, no division by the std (removes the question-difficulty bias).

    Shapes as in ``grpo``; all-equal and singleton groups give exactly 0.
    """
    _check_outcome("dr_grpo", rewards, loss_mask, group_ids)
    return AdvantageOutput(_broadcast(_group_stats(rewards, group_ids).centered, loss_mask), None)


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor, loss_mask: torch.Tensor) -> AdvantageOutput:
    """REINFORCE leave-one-out (RLOO; Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019).

    ``A_i = r_i - (1 / (n - 1)) * sum_{j != i} r_j`` over the n samples of i's group,
    computed as ``n / (n - 1) * (r_i - mean_g)``. A singleton group has no other sample
    to form a baseline: its advantage is 0 (the sample carries no learning signal).
    Shapes as in ``grpo``.
    """
    _check_outcome("rloo", rewards, loss_mask, group_ids)
    st = _group_stats(rewards, group_ids)
    n = st.count[st.index]
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n))
    return AdvantageOutput(_broadcast(scale * st.centered, loss_mask), None)


def lite_ppo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps: float = 1e-6,
    std_unbiased: bool = True,
) -> AdvantageOutput:
    """LitePPO advantage (Liu et al. 2025, "Part I: Tricks or Traps? A Deep Dive into RL
    for LLM Reasoning"): group-level mean, batch-level std.

    ``A_i = (r_i - mean_g(r)) / (std_batch(r) + eps)`` where ``std_batch`` is over all
    ``batch`` rewards (``std_unbiased`` as in ``grpo``). Shapes as in ``grpo``.
    """
    _check_outcome("lite_ppo", rewards, loss_mask, group_ids)
    st = _group_stats(rewards, group_ids)
    r = rewards.double()
    n = torch.tensor([float(r.numel())], dtype=torch.float64)
    batch_std = _std((r - r.mean()).square().sum().reshape(1), n, std_unbiased)
    return AdvantageOutput(_broadcast(_safe_div(st.centered, batch_std.expand_as(r), eps), loss_mask), None)


def reinforce_pp(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262, §3): KL folded into the token reward,
    discounted return per token, then normalised over the whole batch.

    Token reward ``r_t = 1[t = last response token] * r_i - kl_coef * kl_t``
    (``token_rewards``), return ``G_t = sum_{s >= t, valid} gamma^(s-t) r_s``, advantage
    ``A_t = (G_t - mean(G)) / (std(G) + eps)`` with mean and population std over every
    valid token of the batch (float64; all-equal returns give exactly 0).

    Args:
        rewards: ``[batch]`` outcome rewards.
        loss_mask: ``[batch, seq]``, 1 on response tokens.
        kl: ``[batch, seq]`` per-token KL(policy || reference) estimate (``kl.kl_penalty``,
            the paper uses k1), or None for no KL term.
        kl_coef: beta, nats of reward per nat of KL.
        gamma: per-token discount.
        eps: added to the batch std.

    Returns:
        ``AdvantageOutput(advantages, returns=G)``.
    """
    _check_outcome("reinforce_pp", rewards, loss_mask, None)
    g = discounted_returns(token_rewards(rewards, loss_mask, kl=kl, kl_coef=kl_coef), loss_mask, gamma)
    return AdvantageOutput(whiten(g, loss_mask, eps), g.float())


def reinforce_pp_baseline(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> AdvantageOutput:
    """REINFORCE++ with a group baseline ("REINFORCE++-baseline", Hu 2025, §3): the
    group mean reward is subtracted from each outcome reward (exactly 0 for all-equal
    groups) before ``reinforce_pp``'s KL folding, returns and batch normalisation.
    Shapes as in ``reinforce_pp`` plus ``group_ids [batch]``.
    """
    _check_outcome("reinforce_pp_baseline", rewards, loss_mask, group_ids)
    centered = _group_stats(rewards, group_ids).centered
    return reinforce_pp(centered, loss_mask, kl=kl, kl_coef=kl_coef, gamma=gamma, eps=eps)


ESTIMATORS: dict[str, Callable[..., AdvantageOutput]] = {
    "gae": gae,
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "lite_ppo": lite_ppo,
    "multi_turn": multi_turn,
}


def compute_advantages(name: str, **kwargs) -> AdvantageOutput:
    """Run the estimator ``ESTIMATORS[name]``, or the one a graph registered under ``name``
    (``catalog.register_estimator``).

    ``kwargs`` may be a superset of what the estimator takes (e.g. a trainer passes
    ``rewards, group_ids, loss_mask, values`` and the node's estimator knobs (``gamma``,
    ``lam``, ...) to any estimator); arguments the chosen estimator does not take are ignored.

    Raises:
        ValueError: unknown ``name`` (the message lists the known ones).
        TypeError: an argument no estimator takes (a typo), or a required one missing.
    """
    user = user_estimator(name)
    fn = ESTIMATORS.get(name) or (user.fn if user is not None else None)
    if fn is None:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(estimator_names())}")
    known = set().union(*(inspect.signature(f).parameters for f in (*ESTIMATORS.values(), fn)))
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"compute_advantages: no estimator takes {unknown}; known arguments: {sorted(known)}")
    params = inspect.signature(fn).parameters
    missing = [p for p, v in params.items() if v.default is inspect.Parameter.empty and p not in kwargs]
    if missing:
        raise TypeError(f"advantage estimator {name!r} needs {missing}")
    return fn(**{k: v for k, v in kwargs.items() if k in params})
