"""Loss aggregation: per-token losses ``[batch, seq]`` -> one scalar per micro-batch.

Every mode is written as *(sum of per-unit contributions) / (global normaliser)*, where
the normaliser counts the whole optimizer step (all micro-batches, all data-parallel
ranks) and is passed in by the caller. Summing the micro-batch results therefore gives
exactly the loss of the whole step, and the gradient of 2 micro-batches equals the
gradient of 1 batch of the same tokens, in every mode.

Modes (``LossConfig.loss_agg_mode``), with ``m`` the mask, ``L`` the per-token loss,
``N_tok`` the step's valid-token count, ``N_seq`` its count of sequences with >= 1 valid
token, ``|o_i|`` the valid tokens of sequence i:

- ``token-mean``:             sum_i sum_t m L / N_tok (DAPO, Yu et al. 2025, §3.3
  "Token-Level Policy Gradient Loss"; LitePPO).
- ``seq-mean-token-mean``:    sum_i (sum_t m L / |o_i|) / N_seq (GRPO, Shao et al. 2024 eq. 3; GSPO).
- ``seq-mean-token-sum``:     sum_i sum_t m L / N_seq.
- ``seq-mean-token-sum-norm``: sum_i sum_t m L / (N_seq * L_const) (Dr.GRPO, Liu et al.
  2025 §3: a constant length instead of |o_i|, e.g. the generation budget).

Guard: a zero normaliser (all-masked step) is replaced by 1, so the loss is 0, not NaN.
"""

from __future__ import annotations

import torch

from areal_flow.algorithms.config import LOSS_AGG_MODES


def step_normalisers(loss_mask: torch.Tensor) -> tuple[int, int, int]:
    """Counts of one optimizer step's (local) batch.

    Args:
        loss_mask: ``[batch, seq]`` of the whole step (not of one micro-batch).

    Returns:
        ``(n_tokens, n_seqs, max_response_len)``: valid tokens, sequences with at least
        one valid token, most valid tokens in one sequence. Sum the first two (and take
        the max of the third) over data-parallel ranks for the global values.
    """
    per_seq = loss_mask.bool().sum(dim=1)
    return int(per_seq.sum()), int((per_seq > 0).sum()), int(per_seq.max()) if per_seq.numel() else 0


def aggregate_loss(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    *,
    n_tokens: float,
    n_seqs: float,
    norm_length: float | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the step loss.

    Args:
        per_token: ``[batch, seq]`` float loss per token (any value at invalid positions,
            NaN included: they are selected away, not multiplied by 0).
        loss_mask: ``[batch, seq]``, 1 on valid tokens.
        mode: one of ``LOSS_AGG_MODES`` (see module doc).
        n_tokens: valid tokens in the whole optimizer step (global over micro-batches
            and DP ranks); used by ``token-mean``.
        n_seqs: sequences with >= 1 valid token in the whole step; used by the
            ``seq-mean-*`` modes.
        norm_length: the constant length in tokens for ``seq-mean-token-sum-norm``.

    Returns:
        0-dim float32 tensor.

    Raises:
        ValueError: unknown mode, or ``seq-mean-token-sum-norm`` without ``norm_length``.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {LOSS_AGG_MODES}")
    mask = loss_mask.bool()
    masked = torch.where(mask, per_token.float(), torch.zeros((), dtype=torch.float32))
    if mode == "token-mean":
        return masked.sum() / max(float(n_tokens), 1.0)
    if mode == "seq-mean-token-mean":
        per_seq_len = mask.sum(dim=1).clamp(min=1)
        return (masked.sum(dim=1) / per_seq_len).sum() / max(float(n_seqs), 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(float(n_seqs), 1.0)
    if norm_length is None or norm_length <= 0:
        raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs a positive norm_length (tokens)")
    return masked.sum() / (max(float(n_seqs), 1.0) * float(norm_length))
