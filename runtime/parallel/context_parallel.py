"""Context (sequence) parallelism with Ulysses all-to-all attention.

Each of the ``cp`` ranks holds a contiguous chunk of ``seq / cp`` tokens of
every sequence. Everything except attention is token-wise and runs on the
chunk; attention (DeepSpeed-Ulysses, Jacobs et al. 2023, sec. 3) swaps the
split: one all-to-all turns ``[batch, heads, seq/cp, head_dim]`` query/key/
value chunks into ``[batch, heads/cp, seq, head_dim]`` (all tokens, a slice of
heads), exact causal attention runs per head, and a second all-to-all turns
the output back into sequence chunks.

Why Ulysses rather than ring attention: it computes the softmax in one piece
(the same arithmetic as one device, so results compare to a single process at
fp32 rounding), reuses the stock attention kernel (SDPA here, flash on GPU)
with GQA and causal masking unchanged, moves ``4 / cp`` of the activations per
layer instead of passing every KV chunk around a ring, and needs no
load-balancing of causal work. Its limit is ``cp`` dividing the heads (and KV
heads) per TP rank, checked before launch by ``validate``; ring attention
would be the choice beyond that, or for sequences whose full length does not
fit one device's attention for even one head.

Causal masking only: the padding mask is not used (for right-padded batches
this is exact on every valid token, see ``pipeline``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from runtime.parallel.collectives import all_to_all

ATTENTION_NAME = "areal_flow_ulysses"


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """``[batch, heads, seq/cp, d]`` sequence chunk -> ``[batch, heads/cp, seq, d]`` head slice."""
    batch, heads, chunk, dim = x.shape
    parts = x.reshape(batch, cp, heads // cp, chunk, dim).transpose(0, 1)
    received = all_to_all(parts, group)  # [cp (source rank = sequence chunk), batch, heads/cp, chunk, d]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // cp, cp * chunk, dim)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """``[batch, heads/cp, seq, d]`` head slice -> ``[batch, heads, seq/cp, d]`` sequence chunk."""
    batch, head_slice, seq, dim = x.shape
    parts = x.reshape(batch, head_slice, cp, seq // cp, dim).permute(2, 0, 1, 3, 4)
    received = all_to_all(parts, group)  # [cp (source rank = head slice), batch, heads/cp, chunk, d]
    return received.transpose(0, 1).reshape(batch, cp * head_slice, seq // cp, dim)


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    group: dist.ProcessGroup,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention over the whole sequence from per-rank sequence chunks.

    Args:
        query: ``[batch, heads, seq/cp, head_dim]`` (after RoPE with global positions).
        key, value: ``[batch, kv_heads, seq/cp, head_dim]``.
        attention_mask: ignored (causal only, see module docstring).
        group: the ``cp`` process group.

    Returns:
        ``([batch, seq/cp, heads, head_dim], None)``, the layout ``transformers``
        attention functions return.
    """
    cp = dist.get_world_size(group)
    q, k, v = (_seq_to_heads(t, group, cp) for t in (query, key, value))
    kwargs.pop("is_causal", None)
    out, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)  # [b, seq, heads/cp, d]
    out = _heads_to_seq(out.transpose(1, 2), group, cp)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    return None


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Route ``model``'s attention through :func:`ulysses_attention` on ``cp_mesh``.

    Registers the attention function (and a mask function that builds no
    mask) in this process's ``transformers`` attention registries under
    :data:`ATTENTION_NAME`, and selects it in ``model.config``. The caller
    feeds each rank its sequence chunk and global position ids
    (:func:`sequence_chunk`).
    """
    AttentionInterface.register(ATTENTION_NAME, partial(ulysses_attention, group=cp_mesh.get_group()))
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    model.config._attn_implementation = ATTENTION_NAME


def sequence_chunk(x: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """Rank ``cp_rank``'s contiguous chunk of ``x`` ``[batch, seq, ...]`` along ``seq``.

    Raises:
        ValueError: ``seq`` is not divisible by ``cp``.
    """
    if x.shape[1] % cp:
        raise ValueError(f"sequence length {x.shape[1]} must be divisible by cp={cp} for context parallelism")
    chunk = x.shape[1] // cp
    return x[:, cp_rank * chunk : (cp_rank + 1) * chunk]


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rank):  # type: ignore[override]
        ctx.chunk, ctx.rank = x.shape[1], rank
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        start = ctx.rank * ctx.chunk
        return grad_output[:, start : start + ctx.chunk], None, None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, rank: int) -> torch.Tensor:
    """The whole sequences ``[batch, seq, ...]`` from every cp rank's chunk ``x [batch, seq/cp, ...]``
    (rank order), for a function that *every* cp rank then computes identically (a loss).

    Backward takes this rank's chunk of the incoming gradient and sums nothing: each rank
    differentiates the same function of the same gathered tensor, so its chunk's share of the
    gradient is already whole on it (an all-gather's usual backward, a reduce-scatter, would
    count it ``cp`` times).

    Args:
        group: the cp group; ``rank``: this rank's index in it.
    """
    return _GatherSequence.apply(x, group, rank)
