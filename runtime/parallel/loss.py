"""Token-mean cross-entropy over a whole optimizer step, for any parallel layout.

The loss of an optimizer step is the mean over *all* valid tokens of the step
(every micro-batch, every data/context-parallel rank):

    L = sum_{tokens t valid} -log p(y_t | y_<t) / N,   N = global number of valid tokens.

Each micro-batch on each rank contributes its *sum* divided by the global
``N`` (all-reduced before the first micro-batch), so summing the micro-batch
gradients (accumulation) and summing the ranks' gradients (FSDP with divide
factor 1) gives exactly the gradient of ``L``; no factor depends on how tokens
are spread across micro-batches or ranks. This is the token-level aggregation
of DAPO (Yu et al. 2025, sec. 3.3), applied here to the language-model loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Next-token targets aligned with the logits of each position.

    Args:
        input_ids: ``[batch, seq]`` int64.
        loss_mask: ``[batch, seq]``, 1 on tokens whose log-probability counts.

    Returns:
        ``[batch, seq]`` int64: position ``t`` holds ``input_ids[t + 1]`` when
        ``loss_mask[t + 1]`` is set, else :data:`IGNORE_INDEX` (also at the last
        position). Shifting before the sequence is split lets each
        context-parallel chunk compute its loss without its neighbour's tokens.
    """
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = torch.where(loss_mask[:, 1:].bool(), input_ids[:, 1:], IGNORE_INDEX)
    return labels


def global_token_count(labels: torch.Tensor, group: dist.ProcessGroup | None) -> int:
    """Valid targets in ``labels`` summed over ``group`` (the ``dp_cp`` ranks); local if ``group`` is None."""
    count = (labels != IGNORE_INDEX).sum().to(torch.int64).reshape(1)
    if group is not None:
        dist.all_reduce(count, group=group)
    return int(count.item())


class TokenMeanLoss:
    """``loss(logits, labels)``: the summed token loss of one micro-batch divided by the step's global count.

    Set :attr:`n_global_tokens` once per optimizer step (from
    :func:`global_token_count`) before the first micro-batch. A pipeline
    schedule calls this object as its ``loss_fn``.
    """

    def __init__(self) -> None:
        self.n_global_tokens = 0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Args: logits ``[batch, seq, vocab]`` (any float dtype, computed in fp32); labels ``[batch, seq]``.

        Raises:
            RuntimeError: :attr:`n_global_tokens` was not set (is 0).
        """
        if self.n_global_tokens <= 0:
            raise RuntimeError("TokenMeanLoss.n_global_tokens is not set: call global_token_count first")
        token_sum = F.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return token_sum / self.n_global_tokens
