"""Causal attention inside each sequence of a packed row, shared prefixes included.

Owns the attention the policy's forward uses on packed rows (``areal_flow.algorithms.
micro_batches``). ``transformers``' own SDPA path builds a block-diagonal ``[L, L]`` mask for a
packed row and computes all ``L^2`` scores (quadratic in the row, not in its sequences);
here the row is cut into :class:`PackedGroup` s and each attends to itself only, one
``torch.nn.functional.scaled_dot_product_attention`` call per group, so the cost is the sum of
``n^2`` over the groups, as in varlen flash attention. A group is one sequence (causal,
``is_causal=True``) or a *root* sequence followed by *branches* that continue the root's first
``q`` tokens (``areal_flow.algorithms.shared_prefix``): a branch token attends to those ``q``
root tokens and causally to its own branch (a boolean ``[n, n]`` mask of the group). The
implementation is registered with ``transformers.AttentionInterface`` when
:func:`packed_attention` is first entered (not at import) and only selected inside that
context, which also says where the groups are.

On CPU a 16-bit query, or any under autocast (the trainer's ``model.dtype=bfloat16``, whose
rotary embedding hands fp32 queries that autocast would cast to bf16), is attended in fp32:
torch's CPU flash attention forward + backward in bf16 took 2.87-2.93 ms against 1.35-1.46 ms
in fp32 for one 128-token group (SmolLM2's 9 query / 3 key-value heads, 2 threads; with the
casts 1.57-1.61 ms), and fp32 scores are the more accurate (docs/PERFORMANCE.md, "The bf16
trainer"). On CUDA 16-bit stays 16-bit. Only this packed path does so: a padded micro-batch
(``train.pack_sequences=false``), a multi-rank trainer's micro-batches and context-parallel
attention still run ``transformers``' / their own SDPA in the autocast dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass

import torch

NAME = "areal_flow_packed_sdpa"
"""The ``config._attn_implementation`` name of this attention."""


@dataclass(frozen=True)
class PackedGroup:
    """Tokens ``[start, end)`` of a packed row that attend among themselves only.

    Attributes:
        start / end: the group's span of the packed row, tokens.
        branches: ``(offset, shared)`` of each branch, in order: it starts ``offset`` tokens
            after ``start`` and continues the root's first ``shared`` tokens (its positions are
            ``shared, shared + 1, ...``). The root is ``[start, start + first offset)``
            (the whole group without branches).
    """

    start: int
    end: int
    branches: tuple[tuple[int, int], ...] = ()


@functools.lru_cache(maxsize=64)
def group_mask(group: PackedGroup, device: torch.device) -> torch.Tensor:
    """``[n, n]`` bool, True where query token ``i`` of ``group`` (``n`` tokens) may attend to key
    token ``j``: ``j`` is in ``i``'s own sequence (root or branch) and not after it, or ``j`` is one
    of the root's first ``shared`` tokens of ``i``'s branch."""
    n = group.end - group.start
    bounds = [0, *(o for o, _ in group.branches), n]
    seg = torch.cat([torch.full((e - s,), k) for k, (s, e) in enumerate(zip(bounds, bounds[1:]))])
    shared = torch.tensor([0, *(q for _, q in group.branches)])
    pos = torch.cat([torch.arange(q, q + e - s) for q, s, e in zip(shared.tolist(), bounds, bounds[1:])])
    own = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    from_root = (seg[None, :] == 0) & (pos[None, :] < shared[seg][:, None])
    return (own | from_root).to(device)


_GROUPS: ContextVar[tuple[PackedGroup, ...] | None] = ContextVar("areal_flow_packed_groups", default=None)


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of a packed row, called by a ``transformers`` attention layer inside
    :func:`packed_attention` (which gives the row's groups).

    Args:
        query: ``[1, heads, L, head_dim]``; key / value: ``[1, kv_heads, L, head_dim]``.
        attention_mask: None (``transformers`` builds none for an implementation without a
            mask function).
        dropout / scaling: the layer's (dropout is 0 for the policy: models train without it).

    Returns:
        ``([1, L, heads, head_dim], None)``, the layout ``transformers``' SDPA path returns.

    Raises:
        ValueError: outside :func:`packed_attention`, more than one row, an attention mask, or
            groups that do not cover the row's ``L`` tokens.
    """
    groups = _GROUPS.get()
    length = query.shape[2]
    if groups is None or query.shape[0] != 1 or attention_mask is not None or groups[-1].end != length:
        raise ValueError(f"{NAME}: needs one packed row [1, L] inside packed_attention(model, groups) with groups "
                         f"covering its L tokens and no attention mask (got {query.shape[0]} rows of {length}, "
                         f"groups ending at {groups[-1].end if groups else None}, mask {attention_mask is not None})")
    gqa = query.shape[1] != key.shape[1]
    p = dropout if module.training else 0.0
    dtype = query.dtype
    on_cpu = query.device.type == "cpu"  # the module's docstring: no 16-bit SDPA on CPU (autocast would cast to it)
    in_fp32 = on_cpu and (dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled("cpu"))
    if in_fp32:
        query, key, value = query.float(), key.float(), value.float()
    out = []
    with torch.autocast("cpu", enabled=False) if in_fp32 else nullcontext():
        for g in groups:
            s, e = g.start, g.end
            mask = group_mask(g, query.device) if g.branches else None
            out.append(torch.nn.functional.scaled_dot_product_attention(
                query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], attn_mask=mask, dropout_p=p,
                is_causal=mask is None, scale=scaling, enable_gqa=gqa))
    return torch.cat(out, dim=2).to(dtype).transpose(1, 2).contiguous(), None


@contextmanager
def packed_attention(model: torch.nn.Module, groups: tuple[PackedGroup, ...]) -> Iterator[None]:
    """Inside the context, ``model``'s attention layers run :func:`packed_sdpa` over ``groups``
    (``MicroBatch.attention_groups``: the packed row's sequences, in order, covering it).

    Args:
        model: a ``transformers`` model whose layers read ``model.config._attn_implementation``.
        groups: the packed row's attention groups.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, packed_sdpa)
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = NAME
    token = _GROUPS.set(tuple(groups))
    try:
        yield
    finally:
        _GROUPS.reset(token)
        config._attn_implementation = previous
