"""DAPO's data-side techniques (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale"): dynamic sampling (§3.2), overlong filtering and overlong
reward shaping (§3.4).
Clip-higher and the token-level loss are ``LossConfig`` fields (``clip_eps_high``,
``loss_agg_mode="token-mean"``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from areal_flow.types import Trajectory


def informative_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dynamic-sampling filter as a mask: keep samples whose group's rewards are not all
    equal (all-equal groups have zero group-relative advantage, hence no gradient).

    Args:
        rewards: ``[batch]`` float outcome rewards.
        group_ids: ``[batch]`` int group of each sample; groups may differ in size.

    Returns:
        ``[batch]`` bool, True for samples of groups with ``max != min`` (exact
        comparison; a singleton group counts as all-equal and is dropped).
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [batch]")
    _, index = torch.unique(group_ids, return_inverse=True)
    n = int(index.max()) + 1 if index.numel() else 0
    r = rewards.double()
    hi = torch.full((n,), -torch.inf, dtype=torch.float64).scatter_reduce(0, index, r, "amax")
    lo = torch.full((n,), torch.inf, dtype=torch.float64).scatter_reduce(0, index, r, "amin")
    return (hi != lo)[index]


def is_informative(group: Sequence[Trajectory]) -> bool:
    """True when the group's rewards are not all equal.

    Raises:
        ValueError: a trajectory without a reward (the ``reward`` node has not run).
    """
    rewards = []
    for t in group:
        if t.reward is None:
            raise ValueError(f"dynamic sampling: trajectory {t.sample_id!r} has no reward yet")
        rewards.append(t.reward)
    return len(set(rewards)) > 1


def fill_dynamic_batch(
    sample_groups: Callable[[], Sequence[Sequence[Trajectory]]],
    n_groups: int,
    *,
    max_attempts: int,
) -> list[list[Trajectory]]:
    """Keep calling ``sample_groups()`` and keep the informative groups until ``n_groups``
    are collected (DAPO §3.2: over-sample, filter, keep the batch size constant).

    Args:
        sample_groups: returns a fresh list of groups (each the rewarded trajectories of
            one prompt) per call.
        n_groups: groups wanted in the batch (surplus from the last call is dropped).
        max_attempts: most calls to ``sample_groups`` before giving up.

    Returns:
        exactly ``n_groups`` groups, in the order they were sampled.

    Raises:
        ValueError: ``n_groups < 1`` or ``max_attempts < 1``.
        RuntimeError: the batch is still short after ``max_attempts`` calls; the message
            gives the counts (so a reward that is constant everywhere is visible).
    """
    if n_groups < 1 or max_attempts < 1:
        raise ValueError(f"fill_dynamic_batch: n_groups={n_groups} and max_attempts={max_attempts} must be >= 1")
    kept: list[list[Trajectory]] = []
    seen = 0
    for _ in range(max_attempts):
        for group in sample_groups():
            seen += 1
            if is_informative(group):
                kept.append(list(group))
                if len(kept) == n_groups:
                    return kept
    raise RuntimeError(
        f"dynamic sampling: only {len(kept)}/{n_groups} groups with non-constant rewards after "
        f"{max_attempts} calls ({seen} groups sampled, {seen - len(kept)} dropped as all-equal); "
        "raise max_attempts or check the reward function"
    )


def overlong_penalty(response_lengths: torch.Tensor, *, max_length: int, cache_length: int) -> torch.Tensor:
    """Soft overlong punishment (DAPO §3.4, eq. 13), added to the outcome reward.

    With ``L_max = max_length`` and ``L_cache = cache_length`` (tokens):
    ``0`` if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` if
    ``L_max - L_cache < |y| <= L_max`` (linear from 0 to -1); ``-1`` if ``|y| > L_max``.

    Args:
        response_lengths: ``[batch]`` int, response tokens per sample.
        max_length: L_max, tokens.
        cache_length: L_cache, tokens, ``0 < cache_length <= max_length``.

    Returns:
        ``[batch]`` float32 penalty in ``[-1, 0]``.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"overlong_penalty: need 0 < cache_length ({cache_length}) <= max_length ({max_length})")
    length = response_lengths.double()
    start = float(max_length - cache_length)
    soft = (start - length) / cache_length
    out = torch.where(length <= start, torch.zeros_like(length), soft)
    return torch.where(length > max_length, torch.full_like(length, -1.0), out).float()


def overlong_filter(loss_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering (DAPO §3.4): the loss mask with every truncated sample's row zeroed,
    so a response cut at the length limit gives no gradient whatever its reward (TRL's
    ``mask_truncated_completions``). The truncated samples still count in their group's
    advantage statistics, which are computed before; the step's token and sequence counts
    (the loss's normaliser) leave them out.

    Args:
        loss_mask: ``[batch, seq]`` float, 1 on the tokens the loss covers.
        truncated: ``[batch]`` bool, True for a response cut at ``max_new_tokens``
            (``finish_reason == "length"``).

    Returns:
        ``[batch, seq]`` a new mask (``loss_mask`` is not changed).

    Raises:
        ValueError: ``truncated`` is not ``[batch]`` for ``loss_mask``'s batch.
    """
    if loss_mask.dim() != 2 or truncated.shape != loss_mask.shape[:1]:
        raise ValueError(f"overlong_filter: truncated {tuple(truncated.shape)} must be [batch] for loss_mask "
                         f"{tuple(loss_mask.shape)}")
    return loss_mask * (~truncated.bool()).to(loss_mask.dtype).unsqueeze(1)
