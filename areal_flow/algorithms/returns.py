"""Token-level returns: token rewards, discounted returns, GAE, multi-turn returns.

The recursions run right to left over the *valid* tokens of each row only: the
successor of a valid token is the next valid token in the same row, and the last valid
token is terminal (no bootstrap value after it). Padding and masked-out positions (e.g.
tool output inside a multi-turn response) never enter the recursion, whatever values
they hold (NaN included). A truncated response (``finish_reason == "length"``) is
treated as terminal too; shape its reward with ``dapo.overlong_penalty`` if wanted.

All arithmetic is float64; outputs are float32 and exactly 0 where ``loss_mask`` is 0.
Estimators built here are re-exported and selectable from ``advantages.ESTIMATORS``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class AdvantageOutput(NamedTuple):
    """Result of every advantage estimator.

    Attributes:
        advantages: ``[batch, seq]`` float32, 0 where ``loss_mask`` is 0.
        returns: ``[batch, seq]`` float32 returns / value targets where the estimator
            defines them (GAE, REINFORCE++, multi-turn), else None.
    """

    advantages: torch.Tensor
    returns: torch.Tensor | None


def _zeros_where_invalid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype))


def last_token_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[batch]`` int64 index of the last valid token per row; -1 for an empty response."""
    mask = loss_mask.bool()
    seq = mask.shape[1]
    pos = torch.arange(seq).expand_as(mask)
    return torch.where(mask, pos, torch.full_like(pos, -1)).amax(dim=1) if seq else torch.full((mask.shape[0],), -1)


def token_rewards(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Spread an outcome reward over tokens, optionally with a per-token KL penalty.

    ``r_t = 1[t = last valid token] * rewards[b] - kl_coef * kl[b, t]`` on valid tokens
    (the KL-in-reward form of Ouyang et al. 2022 eq. 2 and REINFORCE++). The outcome
    reward of an empty response (no valid token) is dropped: there is no token to credit.

    Args:
        rewards: ``[batch]`` outcome reward, or ``[batch, seq]`` already token-level
            (then only the KL term is added).
        loss_mask: ``[batch, seq]``, 1 on response tokens.
        kl: ``[batch, seq]`` per-token KL estimate in nats (``kl.kl_penalty``), or None.
        kl_coef: weight of the KL term.

    Returns:
        ``[batch, seq]`` float64, 0 where ``loss_mask`` is 0.
    """
    mask = loss_mask.bool()
    if rewards.dim() == 2:
        if rewards.shape != mask.shape:
            raise ValueError(f"token rewards {tuple(rewards.shape)} do not match loss_mask {tuple(mask.shape)}")
        out = _zeros_where_invalid(rewards.double(), mask)
    elif rewards.dim() == 1 and rewards.shape[0] == mask.shape[0]:
        last = last_token_index(mask)
        has = last >= 0
        out = torch.zeros(mask.shape, dtype=torch.float64)
        out[has.nonzero().flatten(), last[has]] = rewards.double()[has]
    else:
        raise ValueError(
            f"rewards must be [batch] or [batch, seq]; got {tuple(rewards.shape)} for loss_mask {tuple(mask.shape)}"
        )
    if kl is not None and kl_coef != 0.0:
        if kl.shape != mask.shape:
            raise ValueError(f"kl {tuple(kl.shape)} does not match loss_mask {tuple(mask.shape)}")
        out = out - kl_coef * _zeros_where_invalid(kl.double(), mask)
    return out


def discounted_returns(token_reward: torch.Tensor, loss_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_next`` over valid tokens (``next`` = next valid token in
    the row). ``token_reward`` and ``loss_mask`` are ``[batch, seq]``; returns float64,
    0 where invalid."""
    mask = loss_mask.bool()
    r = token_reward.double()
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=torch.float64)
    for t in range(r.shape[1] - 1, -1, -1):
        g = r[:, t] + gamma * running
        running = torch.where(mask[:, t], g, running)
        out[:, t] = _zeros_where_invalid(g, mask[:, t])
    return out


def whiten(x: torch.Tensor, loss_mask: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` with mean and population std over valid tokens of the
    whole batch (float64). All-equal values (or no valid token) give exactly 0.
    ``x`` and ``loss_mask`` are ``[batch, seq]``; returns float32."""
    mask = loss_mask.bool()
    vals = x.double()[mask]
    if vals.numel() == 0 or bool(vals.max() == vals.min()):
        return torch.zeros(mask.shape, dtype=torch.float32)
    mean = vals.mean()
    std = (vals - mean).square().mean().sqrt()
    return _zeros_where_invalid((x.double() - mean) / (std + eps), mask).float()


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> AdvantageOutput:
    """Generalized Advantage Estimation (Schulman et al. 2016, eq. 16) with a critic.

    ``delta_t = r_t + gamma * V_next - V_t`` (``V_next`` = value at the next valid token,
    0 after the last one), ``A_t = sum_l (gamma * lam)^l delta_{t+l}`` over valid tokens,
    computed by the recursion ``A_t = delta_t + gamma * lam * A_next``. Value targets
    (returns) are ``A_t + V_t``.

    Args:
        rewards: ``[batch]`` outcome reward (credited to the last response token) or
            ``[batch, seq]`` token rewards (e.g. from ``token_rewards`` with KL folded in).
        values: ``[batch, seq]`` critic values, ``values[b, t]`` = V(state before token t),
            aligned with ``loss_mask``; padding entries are ignored (may be NaN).
        loss_mask: ``[batch, seq]``, 1 on response tokens.
        gamma: per-token discount.
        lam: GAE lambda (1 = Monte-Carlo returns minus V, 0 = one-step TD).

    Returns:
        ``AdvantageOutput(advantages [batch, seq], returns [batch, seq])`` float32.

    Raises:
        ValueError: shape mismatch or a non-finite value on a valid token.
    """
    mask = loss_mask.bool()
    if values.shape != mask.shape:
        raise ValueError(f"gae: values {tuple(values.shape)} do not match loss_mask {tuple(mask.shape)}")
    if not bool(torch.isfinite(values[mask]).all()):
        raise ValueError("gae: non-finite critic value on a response token")
    r = token_rewards(rewards, mask)
    v = values.double()
    adv = torch.zeros_like(v)
    next_value = torch.zeros(v.shape[0], dtype=torch.float64)
    next_adv = torch.zeros(v.shape[0], dtype=torch.float64)
    for t in range(v.shape[1] - 1, -1, -1):
        m = mask[:, t]
        a = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
        adv[:, t] = _zeros_where_invalid(a, m)
        next_value = torch.where(m, v[:, t], next_value)
        next_adv = torch.where(m, a, next_adv)
    returns = _zeros_where_invalid(adv + v, mask)
    return AdvantageOutput(adv.float(), returns.float())


def multi_turn(
    turn_rewards: torch.Tensor,
    turn_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    mode: str = "turn",
    group_ids: torch.Tensor | None = None,
    baseline: str = "none",
) -> AdvantageOutput:
    """Discounted returns across the turns of a multi-turn trajectory.

    ``mode="turn"``: one step per turn, ``G_k = sum_{j >= k} gamma^(j-k) R_j`` for turn
    rewards ``R_j`` (the discounted return, Sutton & Barto 2018 eq. 3.8); every policy
    token of turn k gets ``G_k``. ``mode="token"``: one step per policy token, ``R_k`` is
    credited to the last policy token of turn k and ``G_t = r_t + gamma * G_next`` over
    policy tokens only (``discounted_returns``), so observation tokens between turns
    neither reset nor discount the return. ``baseline="group"``: subtract from every token
    the mean over the episode's group (``group_ids``) of the episodes' returns at their
    first policy token (``G_0``), the group baseline of GRPO/RLOO over whole episodes;
    the value targets (``returns``) stay without it.

    Args:
        turn_rewards: ``[batch, n_turns]`` float; turns a trajectory does not have hold 0.
        turn_ids: ``[batch, seq]`` int64, the turn index (0-based) of each token; read
            only where ``loss_mask`` is 1.
        loss_mask: ``[batch, seq]``, 1 on trainable (model-generated) tokens.
        gamma: discount per turn (``"turn"``) or per policy token (``"token"``).
        mode: ``"turn"`` or ``"token"``.
        group_ids: ``[batch]`` int64 episode group of each row (``baseline="group"``).
        baseline: ``"none"`` or ``"group"``.

    Returns:
        ``AdvantageOutput(advantages, returns)``, both ``[batch, seq]`` float32, 0 where
        ``loss_mask`` is 0.

    Raises:
        ValueError: a turn id outside ``[0, n_turns)`` on a valid token, shape mismatch,
            an unknown ``mode``/``baseline``, or ``baseline="group"`` without ``group_ids``.
    """
    mask = loss_mask.bool()
    if turn_rewards.dim() != 2 or turn_rewards.shape[0] != mask.shape[0] or turn_ids.shape != mask.shape:
        raise ValueError(
            f"multi_turn: turn_rewards {tuple(turn_rewards.shape)} must be [batch, n_turns] and turn_ids "
            f"{tuple(turn_ids.shape)} must match loss_mask {tuple(mask.shape)}"
        )
    if mode not in ("turn", "token") or baseline not in ("none", "group"):
        raise ValueError(f"multi_turn: mode must be 'turn' or 'token' (got {mode!r}), baseline 'none' or 'group' "
                         f"(got {baseline!r})")
    n_turns = turn_rewards.shape[1]
    ids = turn_ids[mask]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_turns):
        got = ids.unique().tolist()
        raise ValueError(f"multi_turn: turn_ids on response tokens must be in [0, {n_turns}), got {got}")
    if n_turns == 0:
        returns = torch.zeros(mask.shape, dtype=torch.float64)
    elif mode == "turn":
        g = torch.zeros(turn_rewards.shape, dtype=torch.float64)
        running = torch.zeros(turn_rewards.shape[0], dtype=torch.float64)
        for k in range(n_turns - 1, -1, -1):
            running = turn_rewards[:, k].double() + gamma * running
            g[:, k] = running
        returns = _zeros_where_invalid(g.gather(1, turn_ids.clamp(0, n_turns - 1)), mask)
    else:
        r = torch.zeros(mask.shape, dtype=torch.float64)
        pos = torch.arange(mask.shape[1]).expand_as(mask)
        for k in range(n_turns):
            last = torch.where(mask & (turn_ids == k), pos, torch.full_like(pos, -1)).amax(dim=1)
            rows = (last >= 0).nonzero().flatten()
            r[rows, last[rows]] += turn_rewards[rows, k].double()
        returns = discounted_returns(r, mask, gamma)
    adv = returns
    if baseline == "group":
        if group_ids is None or group_ids.shape != (mask.shape[0],):
            raise ValueError("multi_turn: baseline='group' needs group_ids [batch]")
        first = torch.where(mask, torch.arange(mask.shape[1]).expand_as(mask), mask.shape[1]).amin(dim=1)
        has = first < mask.shape[1]
        g0 = torch.zeros(mask.shape[0], dtype=torch.float64)
        g0[has] = returns[has.nonzero().flatten(), first[has]]
        _, index = torch.unique(group_ids, return_inverse=True)
        n = int(index.max()) + 1 if index.numel() else 0
        count = torch.zeros(n, dtype=torch.float64).index_add_(0, index, has.double())
        mean = torch.zeros(n, dtype=torch.float64).index_add_(0, index, g0) / count.clamp(min=1)
        adv = _zeros_where_invalid(returns - mean[index][:, None], mask)
    return AdvantageOutput(adv.float(), returns.float())
