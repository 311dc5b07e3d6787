"""Causal attention inside each sequence of a packed row: one SDPA call per sequence.

Owns the attention the policy's forward uses on packed rows (``areal_flow.algorithms.
micro_batches``). ``transformers``' own SDPA path builds a block-diagonal ``[L, L]`` mask for a
packed row and computes all ``L^2`` scores (quadratic in the row, not in its sequences);
here each sequence ``[s, e)`` of the row attends causally to itself only
(``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``), so the cost is
the sum of ``n^2`` over its sequences, as in varlen flash attention. The implementation is
registered with ``transformers.AttentionInterface`` when :func:`packed_attention` is first
entered (not at import) and only selected inside that context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface

NAME = "areal_flow_packed_sdpa"
"""The ``config._attn_implementation`` name of this attention."""


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                position_ids: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of a packed row, called by a ``transformers`` attention layer.

    Args:
        query: ``[1, heads, L, head_dim]``; key / value: ``[1, kv_heads, L, head_dim]``.
        attention_mask: None (``transformers`` builds none for an implementation without a
            mask function).
        position_ids: ``[1, L]``, 0 where each sequence starts and +1 per token inside it.
        dropout / scaling: the layer's (dropout is 0 for the policy: models train without it).

    Returns:
        ``([1, L, heads, head_dim], None)``, the layout ``transformers``' SDPA path returns.

    Raises:
        ValueError: more than one row, no ``position_ids``, or an attention mask.
    """
    if query.shape[0] != 1 or position_ids is None or attention_mask is not None:
        raise ValueError(f"{NAME}: needs one packed row [1, L] with position_ids and no attention mask "
                         f"(got {query.shape[0]} rows, position_ids {position_ids is not None}, "
                         f"mask {attention_mask is not None})")
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()
    bounds = zip(starts, starts[1:] + [query.shape[2]])
    gqa = query.shape[1] != key.shape[1]
    out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout if module.training else 0.0,
        is_causal=True, scale=scaling, enable_gqa=gqa) for s, e in bounds], dim=2)
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def packed_attention(model: torch.nn.Module) -> Iterator[None]:
    """Inside the context, ``model``'s attention layers run :func:`packed_sdpa`.

    Args:
        model: a ``transformers`` model whose layers read ``model.config._attn_implementation``.
    """
    AttentionInterface.register(NAME, packed_sdpa)
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
