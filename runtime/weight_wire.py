"""What a weight version sends: which tensors travel in the wire dtype and which travel once.

``runtime.weights`` (the ZeroMQ channel) and ``runtime.weights_in_process`` (the hybrid
worker's handoff) both ask here. A 16-bit engine holds its layers in its dtype, so the weight
matrices go in it (the plan's ``weights_dtype``, ``areal_flow.dtypes.weights_dtype``); vectors
and the output embedding, which an engine may keep in fp32, go as trained; a tensor that is
another (a tied input and output embedding) goes once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def _identity(t: torch.Tensor) -> tuple:
    """What makes two tensors the same tensor: storage, offset, shape, stride, dtype."""
    return t.device, t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


HEAD = "lm_head.weight"
"""The state-dict name (suffix) of a causal LM's output embedding (Hugging Face's)."""


def head_names(state_dict: Mapping[str, torch.Tensor]) -> frozenset[str]:
    """The output embedding's names: ``*lm_head.weight`` and every tensor that is it or equals it
    (a tied input embedding, also where a copy to CPU or a gather across ranks lost the tie;
    one ``torch.equal`` per tensor of the head's shape and dtype)."""
    heads = [t for n, t in state_dict.items() if n.endswith(HEAD)]
    return frozenset(n for n, t in state_dict.items() if n.endswith(HEAD) or any(
        _identity(t) == _identity(h) or (t.shape == h.shape and t.dtype == h.dtype and t.device == h.device
                                         and torch.equal(t, h)) for h in heads))


def cast_on_wire(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
                 heads: frozenset[str] | None = None) -> frozenset[str]:
    """The names whose tensors a weight channel sends in ``dtype``: floating matrices and larger
    (every product's weights, which an engine of that dtype holds in it), not vectors (norm
    scales, biases: an engine may keep its final norm in fp32, at a few KB) and not the output
    embedding (:func:`head_names`, or ``heads`` when computed): an engine may keep its LM head in
    fp32 (``gen.lm_head_dtype``), and a tied input embedding is the same tensor. Empty for
    ``dtype=None``."""
    if dtype is None:
        return frozenset()
    heads = head_names(state_dict) if heads is None else heads
    return frozenset(n for n, t in state_dict.items() if t.is_floating_point() and t.dim() >= 2
                     and t.dtype != dtype and n not in heads)


def tied(state_dict: Mapping[str, torch.Tensor], heads: frozenset[str] = frozenset()) -> dict[str, str]:
    """``{name: the earlier name}`` for each tensor that is an earlier one (storage, offset, shape,
    stride and dtype alike), and for each of ``heads`` (:func:`head_names`: equal values) after
    the first: sent once, the receiver points both names at one tensor
    (``runtime.weight_subscriber.WeightSubscriber._materialize``)."""
    seen: dict[tuple, str] = {}
    first_head = next((n for n in state_dict if n in heads), None)
    out = {}
    for name, t in state_dict.items():
        key = _identity(t)
        if name in heads and name != first_head:
            out[name] = first_head
        elif t.numel() and key in seen:
            out[name] = seen[key]
        else:
            seen.setdefault(key, name)
    return out
