"""The elementwise parts of the embedded engine's decoder layer: RMSNorm, residual add,
rotary embedding, SiLU gate.

Owns these functions, and ``FusedOps``, the same by the fused CPU kernels; the decoder
(``runtime.engines.decoder``) calls one or the other between its matrix products and attention.
Each residual add is followed by the next norm (the next sublayer's, or the final norm after the
last layer), so a layer makes two calls of ``add_rms_norm`` and none of a bare norm.

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


class FusedOps:
    """The functions above by the fused CPU kernels (``runtime.engines.cpu_kernels``): one pass and one
    rounding each instead of 3-8 PyTorch ops (``csrc/layer_kernels.cpp``; same formulas). The decoder
    uses this in place of the module (``gen.cpu_kernels``). Inputs must be CPU fp32 / bf16 tensors;
    Qwen3's per-head q/k norm and the once-a-step bare norm keep the PyTorch versions.

    Args:
        kernels: ``torch.ops.areal_flow`` from ``runtime.engines.cpu_kernels.load()``.
    """

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """As :func:`rms_norm` (the first layer's and the final norm: twice a step)."""
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
        """As :func:`add_rms_norm`: ``(h + delta, rms_norm(h + delta))``, each ``[rows, T, hidden]``."""
        return tuple(self.kernels.add_rms_norm(h.contiguous(), delta.contiguous(), weight, eps))

    def rope_split(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, qk_eps: float):
        """As :func:`rope_split` (same arguments and results; ``q`` and ``k`` come back contiguous)."""
        if q_norm is not None:
            return rope_split(qkv, cos, sin, n_heads, n_kv, q_norm, k_norm, qk_eps)
        rows, t, width = qkv.shape
        hd = width // (n_heads + 2 * n_kv)
        q, k = self.kernels.rope(qkv.contiguous(), cos.squeeze(1).contiguous(), sin.squeeze(1).contiguous(),
                                 n_heads, n_kv)
        v = qkv[..., (n_heads + n_kv) * hd:].view(rows, t, n_kv, hd).transpose(1, 2)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """As :func:`silu_mul`: ``[rows, T, 2 * intermediate]`` -> ``[rows, T, intermediate]``."""
        return self.kernels.silu_mul(gate_up.contiguous())
