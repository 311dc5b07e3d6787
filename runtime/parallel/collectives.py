"""Differentiable all-to-all along dimension 0, used by Ulysses CP and EP token dispatch.

Forward: rank ``i`` sends rows ``input_split_sizes[j]`` of its input to rank
``j`` and receives ``output_split_sizes[j]`` rows from rank ``j``, concatenated
in rank order. Backward is the same exchange with the two split lists swapped
(the gradient of each received row goes back to the rank that sent it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):  # type: ignore[override]
        ctx.splits = (output_split_sizes, input_split_sizes)
        ctx.group = group
        return _exchange(x, output_split_sizes, input_split_sizes, group)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        output_split_sizes, input_split_sizes = ctx.splits
        return _exchange(grad_output, input_split_sizes, output_split_sizes, ctx.group), None, None, None


def _exchange(x: torch.Tensor, output_split_sizes, input_split_sizes, group) -> torch.Tensor:
    x = x.contiguous()
    if output_split_sizes is None:
        out = torch.empty_like(x)
    else:
        out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes, input_split_sizes, group=group)
    return out


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    """All-to-all of ``x`` ``[rows, ...]`` along dim 0 with autograd.

    Args:
        x: ``[sum(input_split_sizes), ...]`` (or ``[group_size * k, ...]`` when
            the split lists are ``None``: equal chunks).
        group: the process group of the exchange.
        output_split_sizes: rows received from each rank (length = group size).
        input_split_sizes: rows sent to each rank (length = group size).

    Returns:
        ``[sum(output_split_sizes), ...]`` (same shape as ``x`` for equal chunks).
    """
    return _AllToAll.apply(x, output_split_sizes, input_split_sizes, group)
