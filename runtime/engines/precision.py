"""The embedded engine's dtype: forced by config (``gen.dtype``) or chosen by a measured
matrix-product check.

Owns the choice only; the decoder (``runtime.engines.decoder``) casts to it.

``auto`` times one decode-shaped product ``[rows, hidden] @ [hidden, 2 * intermediate]``
(the packed gate+up projection, the largest per layer) in fp32 and in the device's
16-bit type (bf16 on CPU, where AMX / AVX-512-BF16 units make it fast and plain AVX-512
makes it slower; fp16 on CUDA), interleaved, best of several, and picks the 16-bit type
only when it is at least ``MIN_SPEEDUP`` times faster. The answer is cached per process
and shape, so every engine of a process with the same model agrees.
"""

from __future__ import annotations

import time

import torch

ENGINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``gen.dtype`` values besides ``auto`` (spellings of ``areal_flow.config.DTYPES`` are accepted)."""

MIN_SPEEDUP = 1.3
"""``auto`` picks the 16-bit type only when its product is this many times faster than fp32."""

_CHOICES: dict[tuple, torch.dtype] = {}


def engine_dtype(name: str | torch.dtype, device: str, rows: int, hidden: int, intermediate: int) -> torch.dtype:
    """The engine dtype for ``gen.dtype = name``.

    Args:
        name: ``auto``, a torch dtype, or a name of ``areal_flow.config.DTYPES``
            (``float32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``fp16``).
        device: torch device string the engine runs on.
        rows: decode batch rows the check times (the engine's ``max_batch_size``, capped at 64).
        hidden, intermediate: the model's ``hidden_size`` and ``intermediate_size``.

    Raises:
        ValueError: an unknown name (names ``gen.dtype`` and the accepted values).
    """
    from areal_flow.config import DTYPES

    if isinstance(name, torch.dtype):
        return name
    if str(name).lower() != "auto":
        canonical = DTYPES.get(str(name).lower())
        if canonical is None:
            raise ValueError(f"gen.dtype={name!r}: expected auto or one of {', '.join(DTYPES)}")
        return ENGINE_DTYPES[canonical]
    low = torch.float16 if torch.device(device).type == "cuda" else torch.bfloat16
    key = (str(device), min(rows, 64), hidden, intermediate)
    if key not in _CHOICES:
        fp32_s, low_s = matmul_seconds(device, key[1], hidden, 2 * intermediate, (torch.float32, low))
        _CHOICES[key] = low if fp32_s >= MIN_SPEEDUP * low_s else torch.float32
    return _CHOICES[key]


def matmul_seconds(device: str, m: int, k: int, n: int, dtypes: tuple[torch.dtype, ...],
                   repeats: int = 7) -> list[float]:
    """Best-of-``repeats`` seconds of ``[m, k] @ [k, n]`` in each of ``dtypes``, timed
    interleaved (one product of each dtype per round) so load changes hit all alike."""
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    a32, b32 = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    pairs = [(a32.to(dev, d), b32.to(dev, d)) for d in dtypes]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    best = [float("inf")] * len(dtypes)
    for a, b in pairs:  # warm-up: first calls pick kernels
        a @ b
    for _ in range(repeats):
        for i, (a, b) in enumerate(pairs):
            sync()
            start = time.perf_counter()
            a @ b
            sync()
            best[i] = min(best[i], time.perf_counter() - start)
    return best
