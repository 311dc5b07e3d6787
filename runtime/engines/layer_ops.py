"""The elementwise parts of the embedded engine's decoder layer: RMSNorm, residual add,
rotary embedding, SiLU gate.

Owns these functions; the decoder (``runtime.engines.decoder``) calls them between its
matrix products and attention. Each residual add is followed by the next norm (the next
sublayer's, or the final norm after the last layer), so a layer makes two calls of
``add_rms_norm`` and none of a bare norm.

Formulas: RMSNorm ``weight * x / sqrt(mean(x^2) + eps)`` computed in fp32 (Zhang & Sennrich
2019, eq. 4; as ``transformers``' ``Qwen2RMSNorm`` / ``LlamaRMSNorm``), rotary embedding
``x * cos + rotate_half(x) * sin`` on the half-split head layout of ``transformers`` (Su et al.
2021, eq. 34), SwiGLU gate ``silu(gate) * up`` (Shazeer 2020, eq. 6).

Measured, and left eager: ``torch.compile(dynamic=True)`` of these four functions (inductor,
C++ on CPU) made a bf16 decode step of SmolLM2-135M slower, not faster (``bench/engine_step_profile.py``
prints it; numbers in ``docs/PERFORMANCE.md``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., hidden]`` over its last dim with ``weight [hidden]``; same dtype as
    ``x`` (fp32 inside for bf16 / fp16 input)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add then RMSNorm: ``(h + delta, rms_norm(h + delta))``, each ``[rows, T, hidden]``."""
    h = h + delta
    return h, rms_norm(h, weight, eps)


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int,
               q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, qk_eps: float):
    """Split a packed QKV product and rotate queries and keys.

    Args:
        qkv: ``[rows, T, (n_heads + 2 n_kv) * head_dim]``, the packed projection.
        cos: ``[rows, 1, T, head_dim]`` from the model's ``rotary_emb``.
        sin: ``[rows, 1, T, head_dim]``, its first half negated (so that ``rotate_half(x) *
            sin == flip_halves(x) * sin_signed``).
        n_heads, n_kv: query and key/value heads.
        q_norm, k_norm: Qwen3's per-head RMSNorm weights ``[head_dim]`` (None: no norm).
        qk_eps: their epsilon.

    Returns:
        ``q [rows, n_heads, T, hd]``, ``k [rows, n_kv, T, hd]``, ``v [rows, n_kv, T, hd]``.
    """
    rows, t, width = qkv.shape
    hd = width // (n_heads + 2 * n_kv)
    qk = qkv[..., :(n_heads + n_kv) * hd].view(rows, t, n_heads + n_kv, hd)
    v = qkv[..., (n_heads + n_kv) * hd:].view(rows, t, n_kv, hd).transpose(1, 2)
    if q_norm is not None:
        qk = torch.cat((rms_norm(qk[:, :, :n_heads], q_norm, qk_eps), rms_norm(qk[:, :, n_heads:], k_norm, qk_eps)), 2)
    qk = qk.transpose(1, 2)  # [rows, heads + kv_heads, T, hd]: RoPE on q and k at once
    qk = qk * cos + qk.unflatten(-1, (2, hd // 2)).flip(-2).flatten(-2) * sin
    return qk[:, :n_heads], qk[:, n_heads:], v


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for the packed ``gate_up [rows, T, 2 * intermediate]`` -> ``[rows, T, intermediate]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
