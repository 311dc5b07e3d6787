"""One optimizer step of a value model (the PPO critic) on the clipped value loss.

Owns the critic's update, shared by ``BaseAlgorithm`` (a critic stepped with the policy) and
the critic's own ``train_step`` node (``runtime.executors.train``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from areal_flow.algorithms.aggregation import aggregate_loss
from areal_flow.algorithms.config import LossConfig
from areal_flow.algorithms.loss_scale import LossScaler
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
    scaler: LossScaler | None = None,
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
        scaler: under fp16 autocast (``model.dtype=float16``) the critic's dynamic loss scale
            (``areal_flow.algorithms.loss_scale``): the loss is scaled before each backward and
            the gradients unscaled before clipping; None (fp32, bf16): no scaling.

    Returns:
        ``value_loss``, ``value_clip_frac``, ``critic_grad_norm`` (before clipping); with a
        ``scaler`` also ``critic_loss_scale`` (the scale this step used) and
        ``critic_loss_scale_overflow`` (1: the scaled gradients overflowed, the step was skipped
        and the scale halved).
    """
    metrics = StepMetrics()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    optimizer.zero_grad(set_to_none=True)
    for sl in slices:
        w = trimmed_width(attn[sl])
        values = critic(input_ids=ids[sl, :w], attention_mask=attn[sl, :w])
        loss = micro_batch_value_loss(values, batch, mask, sl, norm, loss_cfg, metrics)
        (loss if scaler is None else scaler.scaled(loss)).backward()
    return finish_critic_step(critic.parameters(), optimizer, norm, max_grad_norm, metrics, clip, scaler)


def micro_batch_value_loss(values: torch.Tensor, batch: dict[str, torch.Tensor], mask: torch.Tensor, rows,
                           norm: dict[str, Any], loss_cfg: LossConfig, metrics: StepMetrics) -> torch.Tensor:
    """The clipped value loss of one micro-batch (its share of the step's aggregated loss, see
    :func:`critic_update`), its ``value_loss`` and ``value_clip_frac`` added to ``metrics``.

    Args:
        values: ``[b, w]`` the critic's values of the micro-batch's rows (``ValueModel`` layout),
            ``w`` their width (``trimmed_width``).
        batch, mask, norm, loss_cfg: as :func:`critic_update`'s. rows: the micro-batch's rows of
            ``batch`` (a slice or an index tensor of ``b`` rows).

    Returns:
        The loss, a 0-dim tensor to back-propagate.
    """
    w = values.shape[1]
    m = mask[rows, :w]
    per_token, clipped = value_loss(values, batch["values"][rows, :w], batch["returns"][rows, :w], m,
                                    clip_eps=loss_cfg.value_clip_eps)
    loss = aggregate_loss(per_token, m, loss_cfg.loss_agg_mode, **norm)
    metrics.add_total("value_loss", loss)
    metrics.add_count("value_clip_frac", clipped, m)
    return loss


def finish_critic_step(
    parameters: Iterable[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    norm: dict[str, Any],
    max_grad_norm: float,
    metrics: StepMetrics,
    clip: Callable[[Iterable[torch.nn.Parameter], float], torch.Tensor] = torch.nn.utils.clip_grad_norm_,
    scaler: LossScaler | None = None,
) -> dict[str, float]:
    """Clip the accumulated gradients of ``parameters`` and step ``optimizer``, unless the step
    has no valid token or a non-finite gradient norm (then the gradients are dropped).
    ``scaler``: as :func:`critic_update`'s (the gradients were scaled; unscaled here first).

    Returns:
        ``metrics``' result and ``critic_grad_norm`` (before clipping), and the scale's metrics.
    """
    if scaler is not None:
        scaler.unscale(optimizer)
    grad_norm = clip(parameters, max_grad_norm)
    if norm["n_tokens"] == 0 or not bool(torch.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    result = {**metrics.result(), "critic_grad_norm": float(grad_norm)}
    if scaler is not None:  # an overflow with a finite loss: the scale backs off (not a non-finite step)
        result.update(critic_loss_scale=scaler.scale, critic_loss_scale_overflow=float(
            not bool(torch.isfinite(grad_norm)) and math.isfinite(result.get("value_loss", 0.0))))
        scaler.update()
    return result
