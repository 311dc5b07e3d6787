"""Precision names: the spellings ``model.dtype`` and ``gen.dtype`` accept, and the torch
dtype each means; ``model.dtype=auto`` resolved for the device a trainer runs on.

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

AUTO = "auto"
"""``model.dtype=auto``: bfloat16 where the device multiplies bf16 in hardware (on CPU: and
faster than fp32, where the caller measures it), else float32 (:func:`model_dtype`)."""

MIN_BF16_SPEEDUP = 1.3
"""``model.dtype=auto`` on a CPU with bf16 instructions picks bfloat16 only where the caller's
measured bf16 products are this many times faster than fp32's (as ``gen.dtype=auto``'s
``MIN_SPEEDUP``): an Intel Xeon whose flags list AVX-512 BF16 but not AMX ran them at 0.5-0.7x
fp32's (docs/PERFORMANCE.md)."""

ENGINE = "engine"
"""The ``weights_dtype`` that defers to the engine: each generation replica announces the dtype
its engine chose at start (``gen.dtype=auto``) to the trainer, whose weight matrices then go to
it in that dtype (float32 until it has; ``runtime.workers.tell_trainer``)."""


def wire_dtype_name(value) -> str | None:
    """A ``weights_dtype`` value's canonical name (a :data:`DTYPES` name, or :data:`ENGINE`), None
    for anything else."""
    spelled = str(value).lower()
    return ENGINE if spelled == ENGINE else DTYPES.get(spelled)


def weights_dtype(engine_dtype: str, train_dtype: str, *, engine: str = "embedded", device: str = "cpu") -> str:
    """The dtype a trainer's weight matrices travel in to an engine (a ``sync_weights`` node's
    ``weights_dtype``, written by ``compiler.program``; which tensors count as matrices:
    ``runtime.weight_wire.cast_on_wire``): the dtype the engine holds its layers in when that is
    16-bit and known before it starts, so sending them in it changes nothing the engine computes
    with and moves half the bytes of fp32; :data:`ENGINE` when only the engine will know;
    float32 otherwise.

    * the embedded engine: ``gen.dtype`` when 16-bit; for ``auto`` (decided at engine start: bf16
      on CPU, fp16 on CUDA, or fp32) that 16-bit type when the trainer's ``model.dtype`` is it
      (its forward already rounds every product's weights to it under autocast; an engine that
      chose fp32 then decodes with layers rounded so), else :data:`ENGINE` (the dtype the
      engine announces: a bf16 engine gets bf16 matrices, which it would have rounded the
      trainer's fp32 ones to anyway, an fp32 engine fp32 ones);
    * vLLM, which runs in ``model.dtype``: that dtype when 16-bit; :data:`ENGINE` for
      ``model.dtype=auto`` (resolved on the generator's own device, announced at start).

    With ``model.dtype=auto`` the embedded engine's ``gen.dtype=auto`` also gets :data:`ENGINE`
    (the trainer's dtype is not known before its worker starts either).

    Args:
        engine_dtype: ``gen.dtype`` (any spelling, or ``auto``). train_dtype: ``model.dtype``.
        engine: the generate node's engine (embedded or vllm). device: cpu or cuda.
    """
    spelled, train = str(engine_dtype).lower(), DTYPES.get(str(train_dtype).lower())
    if engine == "vllm":
        return ENGINE if str(train_dtype).lower() == AUTO else train if train in HALF else "float32"
    if DTYPES.get(spelled) in HALF:
        return DTYPES[spelled]
    if spelled != "auto":
        return "float32"
    auto_half = "float16" if device == "cuda" else "bfloat16"
    return train if train == auto_half else ENGINE


def dtype_name(name, key: str, *, extra: tuple[str, ...] = ()) -> str:
    """``name`` (any spelling of :data:`DTYPES`, or a word of ``extra``) -> its canonical name
    (the torch dtype name, or the word in lower case).

    Raises:
        ValueError: anything else, naming ``key`` and the accepted names.
    """
    spelled = str(name).lower()
    if spelled in extra:
        return spelled
    if spelled not in DTYPES:
        raise ValueError(_expected(name, key, extra))
    return DTYPES[spelled]


def _expected(name, key: str, extra: tuple[str, ...]) -> str:
    return f"{key}={name!r}: expected {''.join(f'{w} or ' for w in extra)}one of {', '.join(DTYPES)}"


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
    if str(name).lower() not in DTYPES:
        raise ValueError(_expected(name, key, extra))
    return getattr(torch, DTYPES[str(name).lower()])


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""``/proc/cpuinfo`` flags of a CPU that multiplies bf16 in hardware (AVX-512 BF16's ``vdpbf16ps``,
AMX's tile products); without them oneDNN converts bf16 to fp32 around each product, and a bf16
autocast step runs slower than an fp32 one."""


def cpu_has_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether the CPU multiplies bf16 in hardware: one of :data:`BF16_CPU_FLAGS` in a ``flags``
    line of ``cpuinfo`` (default: ``/proc/cpuinfo`` read now); None when there is none to read
    (not Linux), so a caller can stay silent rather than guess."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags = {w for line in cpuinfo.splitlines() if line.startswith("flags") for w in line.split(":", 1)[-1].split()}
    if not flags:
        return None
    return any(f in flags for f in BF16_CPU_FLAGS)


def model_dtype(name, device_type: str = "cpu", *, cpuinfo: str | None = None, bf16_speedup=None) -> str:
    """``model.dtype`` (any spelling, or :data:`AUTO`) as the torch dtype name the trainer's autocast
    and the engines' source weights use on ``device_type``.

    ``auto`` is bfloat16 where bf16 products run in hardware and float32 elsewhere: on CUDA where
    the device's compute capability is >= 8.0 (``torch.cuda.get_device_capability``; V100 / T4 can
    hold bf16 tensors, which ``torch.cuda.is_bf16_supported()`` counts, but emulate the products);
    on CPU where :func:`cpu_has_bf16` finds AVX-512 BF16 or AMX (without them oneDNN converts bf16
    to fp32 around each product: 30 against 149 GFLOP/s at 256 x 576 x 1,536 and 28 against 88-98
    at decode shapes on one core of an AVX-512 CPU without them, docs/PERFORMANCE.md), and float32
    where the flags cannot be read (also an ARM CPU, whose ``/proc/cpuinfo`` lists ``Features``).
    The instructions are not enough: an Intel Xeon without AMX that lists AVX-512 BF16 multiplied bf16
    at 0.5-0.7x fp32's rate (oneDNN's ``avx512_core_bf16`` kernels; docs/PERFORMANCE.md), so where
    the caller passes ``bf16_speedup`` bfloat16 also needs it to return >= :data:`MIN_BF16_SPEEDUP`
    (the runtime passes ``runtime.engines.precision.autocast_bf16_speedup``, a product timed once a
    process). A multi-rank trainer's other ranks follow rank 0's, and a generator whose engine dtype
    differs announces it (:data:`ENGINE`).

    Args:
        name: the configured value. device_type: ``cpu`` or ``cuda`` (the plan's device type).
        cpuinfo: ``/proc/cpuinfo``'s text (tests); default read now.
        bf16_speedup: a callable returning fp32 seconds / bf16 seconds of the CPU's products, called
            only for ``auto`` on a CPU with bf16 instructions; None: the instructions decide.

    Raises:
        ValueError: an unknown name, naming ``model.dtype``.
    """
    spelled = dtype_name(name, "model.dtype", extra=(AUTO,))
    if spelled != AUTO:
        return spelled
    if device_type == "cuda":
        import torch

        return "bfloat16" if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0) else "float32"
    if not cpu_has_bf16(cpuinfo):
        return "float32"
    return "bfloat16" if bf16_speedup is None or bf16_speedup() >= MIN_BF16_SPEEDUP else "float32"
