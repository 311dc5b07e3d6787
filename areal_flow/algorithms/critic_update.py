"""One optimizer step of a value model (the PPO critic) on the clipped value loss.

Owns the critic's update, shared by ``BaseAlgorithm`` (a critic stepped with the policy) and
the critic's own ``train_step`` node (``runtime.executors.train``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from areal_flow.algorithms.aggregation import aggregate_loss
from areal_flow.algorithms.config import LossConfig
from areal_flow.algorithms.losses import value_loss
from areal_flow.algorithms.micro_batches import trimmed_width
from areal_flow.algorithms.step_metrics import StepMetrics


def critic_update(
    critic: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    mask: torch.Tensor,
    norm: dict[str, Any],
    loss_cfg: LossConfig,
    slices: list[slice],
    max_grad_norm: float,
    clip: Callable[[Iterable[torch.nn.Parameter], float], torch.Tensor] = torch.nn.utils.clip_grad_norm_,
) -> dict[str, float]:
    """One optimizer step of a value model on the clipped value loss (PPO; Schulman et al.
    2017 eq. 9's value term, clipped as in OpenAI baselines ``ppo2``):
    ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)``.

    Args:
        critic: ``critic(input_ids=, attention_mask=) -> [batch, seq]`` values.
        batch: ``input_ids``/``attention_mask`` ``[batch, seq]``, ``values`` (V_old, the
            critic's values before the step) and ``returns`` (targets), ``[batch, seq]``.
        mask: ``[batch, seq]`` bool, the valid response tokens.
        norm: the aggregation normalisers (``aggregation.step_normalisers``).
        loss_cfg: ``value_clip_eps`` and ``loss_agg_mode``.
        slices: the micro-batches' rows.
        max_grad_norm: global L2 norm the gradient is clipped to.
        clip: ``clip(parameters, max_norm) -> norm before clipping``: torch's
            ``clip_grad_norm_`` on one process; a sharded critic passes one that norms over its
            ranks (``runtime.parallel.grad_norm.clip_grad_norm``, the same coefficient).

    Returns:
        ``value_loss``, ``value_clip_frac``, ``critic_grad_norm`` (before clipping).
    """
    metrics = StepMetrics()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    optimizer.zero_grad(set_to_none=True)
    for sl in slices:
        w = trimmed_width(attn[sl])
        m = mask[sl, :w]
        values = critic(input_ids=ids[sl, :w], attention_mask=attn[sl, :w])
        per_token, clipped = value_loss(
            values, batch["values"][sl, :w], batch["returns"][sl, :w], m, clip_eps=loss_cfg.value_clip_eps
        )
        loss = aggregate_loss(per_token, m, loss_cfg.loss_agg_mode, **norm)
        loss.backward()
        metrics.add_total("value_loss", loss)
        metrics.add_count("value_clip_frac", clipped, m)
    grad_norm = clip(critic.parameters(), max_grad_norm)
    if norm["n_tokens"] == 0 or not bool(torch.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return {**metrics.result(), "critic_grad_norm": float(grad_norm)}
