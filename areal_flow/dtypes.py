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


HALF = ("bfloat16", "float16")
"""The 16-bit dtype names."""


def weights_dtype(engine_dtype: str, train_dtype: str) -> str:
    """The dtype a trainer's weight matrices travel in to an engine (a ``sync_weights`` node's
    ``weights_dtype``, written by ``compiler.program``; which tensors count as matrices:
    ``runtime.weights.cast_on_wire``): the engine's own when it is 16-bit (it holds its layers in
    that dtype, so sending them in it changes nothing it computes with and moves half the bytes
    of fp32); for ``gen.dtype=auto`` (decided at engine start) the trainer's when ``model.dtype``
    is 16-bit (its forward already rounds every product's weights to it under autocast; an
    engine that chose fp32 then decodes with layers rounded so); float32 otherwise.

    Args:
        engine_dtype: ``gen.dtype`` (any spelling, or ``auto``). train_dtype: ``model.dtype``.
    """
    engine, train = DTYPES.get(str(engine_dtype).lower()), DTYPES.get(str(train_dtype).lower())
    if engine in HALF:
        return engine
    if str(engine_dtype).lower() == "auto" and train in HALF:
        return train
    return "float32"


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
