"""Matrix products of the embedded engine's decoder (``runtime.engines.decoder``): each weight packed once
for the product that runs it, and that product.

On CPU with oneDNN, every weight (and the LM head) is reordered once
at ``pack`` time into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
the layout inductor's freezing pass uses) and multiplied by ``torch.ops.mkldnn._linear_pointwise``;
``F.linear`` would reorder the weight again on every call (bf16: same kernel, bit-identical
products; fp32: oneDNN instead of MKL, the same sums in another order). Measured on this
CPU (one thread, CPU time, 30 distinct ``[3072, 576]`` weights in turn as in a decode step),
the packed product against ``F.linear``: bf16 1.28x (32 rows) and 1.59x (64 rows) as fast,
fp32 1.23x and 1.19x. Other devices and dtypes keep ``F.linear``. A bf16 engine whose CPU kernels
run their mixed product on AVX-512 BF16 (a CPU without AMX; ``gen.cpu_kernels``) packs its layers' and
a bf16 head's weights for that product instead (:class:`KernelWeight`); with AMX, oneDNN's AMX
products stay.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


def _onednn_packs(weight: torch.Tensor) -> bool:
    """True when ``weight`` can be held in oneDNN's blocked layout: a CPU fp32 tensor, or bf16
    where the CPU has bf16 units (``torch.ops.mkldnn._is_mkldnn_bf16_supported``)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


class KernelWeight(NamedTuple):
    """A bf16 ``weight [out, in]`` packed for the CPU kernels' mixed product (``csrc/lm_head.cpp``,
    ``torch.ops.areal_flow.lm_head`` with ``bf16_out``): exact bf16 products summed in fp32, the bias
    added in fp32, each output rounded once to bf16, as oneDNN's bf16 product (its sums in another
    order). Used where the kernels run that product on AVX-512 BF16 (``mixed_product_isa``); there,
    SmolLM2-135M's layer products streaming from memory ran 1.31-1.33x (32 rows) and 1.16-1.18x (64
    rows) as fast as oneDNN's packed product, one thread (docs/PERFORMANCE.md, "Layer products and
    prefill attention by the kernels")."""

    packed: torch.Tensor
    out_features: int
    kernels: object


def kernel_products(kernels, dtype: torch.dtype) -> bool:
    """Whether ``dtype`` matrices are packed for the CPU kernels' mixed product (:class:`KernelWeight`):
    bf16 where ``kernels`` (``torch.ops.areal_flow``, or None when not loaded) run it on AVX-512 BF16; with
    AMX oneDNN's AMX products stay."""
    return kernels is not None and dtype == torch.bfloat16 and kernels.mixed_product_isa() == "avx512_bf16"


def pack_weight(weight: torch.Tensor, rows: int, kernels=None) -> torch.Tensor | KernelWeight:
    """``weight [out, in]`` packed for :func:`linear`: for the CPU kernels' product when ``kernels``
    (``torch.ops.areal_flow``) is given and ``weight`` is bf16; else in oneDNN's blocked layout for
    products of about ``rows`` rows (any row count works); else ``weight`` itself."""
    if kernels is not None and weight.dtype == torch.bfloat16:
        return KernelWeight(kernels.pack_lm_head(weight), weight.shape[0], kernels)
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows) if _onednn_packs(weight) else weight


def linear(x: torch.Tensor, weight: torch.Tensor | KernelWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., in] @ weight.T + bias`` -> ``[..., out]``, bf16 for a :class:`KernelWeight`, else in the dtype
    oneDNN / ``F.linear`` give (``x``'s); ``weight`` from :func:`pack_weight`."""
    if isinstance(weight, KernelWeight):
        out = weight.kernels.lm_head(x.reshape(-1, x.shape[-1]), weight.packed, weight.out_features, bias, True)
        return out.view(*x.shape[:-1], weight.out_features)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
