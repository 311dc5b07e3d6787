"""Precision names: the spellings ``model.dtype`` and ``gen.dtype`` accept, and the torch
dtype each means.

Owns the one table of names (the config checks it, the runtime and the engines resolve it);
it imports nothing heavy at import time, so the vLLM venv (no omegaconf, no compiler
dependencies) can resolve a dtype too.
"""

from __future__ import annotations

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}
"""Accepted spellings -> the torch dtype name."""


def torch_dtype(name, key: str = "model.dtype", *, extra: tuple[str, ...] = ()):
    """``name`` (a ``torch.dtype`` or any spelling of :data:`DTYPES`) -> ``torch.dtype``.

    Args:
        name: the configured value.
        key: the config key it came from, named in the error.
        extra: further accepted words the caller handles itself (``auto``, ``engine``; named in
            the error only).

    Raises:
        ValueError: an unknown name, naming ``key`` and the accepted names.
    """
    import torch

    if isinstance(name, torch.dtype):
        return name
    canonical = DTYPES.get(str(name).lower())
    if canonical is None:
        raise ValueError(f"{key}={name!r}: expected {''.join(f'{w} or ' for w in extra)}one of {', '.join(DTYPES)}")
    return getattr(torch, canonical)
