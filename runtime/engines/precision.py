"""The embedded engine's dtype: forced by config (``gen.dtype``) or chosen by a measured
check; the trainer's autocast check for ``model.dtype=auto`` (:func:`autocast_bf16_speedup`); and
the matrix-product timing the throughput benchmark uses as the roofline.

Owns the choices only; the decoder (``runtime.engines.decoder``) and the trainer cast to them.
The trainer's check times one product, not a step: a training step is a few large products
(hundreds of tokens a row), which a cache-resident product predicts, where a decode step (below)
is memory- and overhead-bound.

``auto`` builds the engine's decoder in fp32 and in the device's 16-bit type (bf16 on
CPU, where AMX / AVX-512-BF16 units make it fast and plain AVX-512 makes it slower; fp16
on CUDA), times one decode step of ``rows`` sequences at position 32 in each,
interleaved, best of 3 after a warm-up, and picks the 16-bit type only when its step is at
least ``MIN_SPEEDUP`` times faster. A whole step, not one product: a decode step streams
every weight from memory and pays per-op overhead, so a cache-resident product misleads
both ways (measured on this CPU, one thread: at 8 rows one bf16 product of SmolLM2's
shape is 0.95x fp32 while the step is ~2.5x faster; for the 1 M tiny model 64-row products
are 1.6x faster in bf16 while the step, all overhead, is not). The answer is cached per
process, device, rows and model shape, so every engine of a process with the same model
agrees; it costs about two decoder packings and eight decode steps.
"""

from __future__ import annotations

import time

import torch

from areal_flow.dtypes import torch_dtype

MIN_SPEEDUP = 1.3
"""``auto`` picks the 16-bit type only when its decode step is this many times faster than fp32."""

_AUTOCAST_SPEEDUP: dict[int, float] = {}
"""Per torch thread count: :func:`autocast_bf16_speedup`'s measurement."""

_CHOICES: dict[tuple, tuple[torch.dtype, float]] = {}
"""Per (device, rows, model shape): ``auto``'s choice and its measured speedup (below)."""


def engine_dtype(name: str | torch.dtype, device: str, rows: int, model: torch.nn.Module,
                 cpu_kernels: str = "auto") -> torch.dtype:
    """The engine dtype for ``gen.dtype = name``.

    Args:
        name: ``auto``, a torch dtype, or a name of ``areal_flow.dtypes.DTYPES``
            (``float32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``fp16``).
        device: torch device string the engine runs on.
        rows: decode batch rows the check times (the engine's ``max_batch_size``).
        model: the HF causal LM the engine decodes (already on ``device``).
        cpu_kernels: the engine's ``gen.cpu_kernels``; the check times the decoders the engine
            will run (the fused kernels change the ratio: an fp32 SmolLM2 decode step ran 1.19x as
            fast with them as without, docs/PERFORMANCE.md).

    Raises:
        ValueError: an unknown name (names ``gen.dtype`` and the accepted values).
    """
    if isinstance(name, torch.dtype) or str(name).lower() != "auto":
        return torch_dtype(name, "gen.dtype", extra=("auto",))
    low = torch.float16 if torch.device(device).type == "cuda" else torch.bfloat16
    key = _key(device, rows, model, cpu_kernels)
    if key not in _CHOICES:
        fp32_s, low_s = _decode_step_seconds(model, device, rows, (torch.float32, low), cpu_kernels)
        _CHOICES[key] = (low if fp32_s >= MIN_SPEEDUP * low_s else torch.float32, fp32_s / low_s)
    return _CHOICES[key][0]


def auto_speedup(device: str, rows: int, model: torch.nn.Module, cpu_kernels: str = "auto") -> float | None:
    """The decode-step speedup ``auto`` measured for this device, rows and model shape:
    fp32 seconds / 16-bit seconds of one step (> 1: the 16-bit step is faster); None when
    :func:`engine_dtype` has not measured it in this process (e.g. ``gen.dtype`` forced)."""
    choice = _CHOICES.get(_key(device, rows, model, cpu_kernels))
    return None if choice is None else choice[1]


def autocast_bf16_speedup(rows: int = 512, size: int = 1024, rounds: int = 5) -> float:
    """fp32 seconds / bf16 seconds of ``F.linear`` of ``[rows, size]`` by ``[size, size]`` on the CPU
    at torch's current threads: the product a trainer's bf16 autocast runs (a fresh bf16 weight,
    no pre-packed layout), timed interleaved, best of ``rounds`` after a warm-up (~0.1 s at 150
    GFLOP/s). ``model.dtype=auto`` takes bf16 only where this is >= ``MIN_BF16_SPEEDUP``
    (``areal_flow.dtypes.model_dtype``). Cached per thread count in the process."""
    threads = torch.get_num_threads()
    if threads not in _AUTOCAST_SPEEDUP:
        gen = torch.Generator().manual_seed(0)
        pairs = [(torch.randn(rows, size, generator=gen).to(d), torch.randn(size, size, generator=gen).to(d))
                 for d in (torch.float32, torch.bfloat16)]
        with torch.inference_mode():
            fp32_s, bf16_s = _interleaved_best([lambda x=x, w=w: torch.nn.functional.linear(x, w) for x, w in pairs],
                                               rounds)
        _AUTOCAST_SPEEDUP[threads] = fp32_s / bf16_s
    return _AUTOCAST_SPEEDUP[threads]


def _interleaved_best(calls: list, rounds: int, sync=lambda: None) -> list[float]:
    """Best seconds of each of ``calls`` over ``rounds`` rounds of one call of each in turn, after
    a warm-up round (kernel choice, weight layout); ``sync`` waits for the device around each."""
    best = [float("inf")] * len(calls)
    for round_ in range(rounds + 1):
        for i, call in enumerate(calls):
            sync()
            start = time.perf_counter()
            call()
            sync()
            if round_:
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def _key(device: str, rows: int, model: torch.nn.Module, cpu_kernels: str) -> tuple:
    cfg = model.config
    return (str(device), rows, cpu_kernels, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size)


@torch.inference_mode()
def _decode_step_seconds(model, device: str, rows: int, dtypes: tuple[torch.dtype, ...], cpu_kernels: str = "auto",
                         min_rounds: int = 3, max_rounds: int = 30, budget_s: float = 0.5) -> list[float]:
    """Best seconds of one decode step of ``rows`` sequences at position 32 with the
    engine's decoder (``cpu_kernels`` as ``gen.cpu_kernels``) in each of ``dtypes``: interleaved rounds (one step of each dtype)
    after one warm-up round, at least ``min_rounds``, then more while under ``budget_s``
    seconds and ``max_rounds`` rounds (small models get many samples against noise)."""
    from runtime.engines.decoder import KVDecoder

    # the LM head as gen.lm_head_dtype's default (auto) runs it: fp32, or for bf16 the mixed head where it runs
    decoders = [KVDecoder(model, d, rows, torch.float32, cpu_kernels, mixed_head=None if d == torch.bfloat16 else False)
                for d in dtypes]
    ids = torch.randint(model.config.vocab_size, (rows,), generator=torch.Generator().manual_seed(0)).to(device)
    lengths = torch.full((rows,), 32, device=device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    best = [float("inf")] * len(dtypes)
    for dec in decoders:
        dec.reserve(rows, 64)
    started, round_ = time.perf_counter(), 0
    while round_ <= min_rounds or (round_ <= max_rounds and time.perf_counter() - started < budget_s):
        for i, dec in enumerate(decoders):
            sync()
            start = time.perf_counter()
            dec.decode(ids, lengths)
            sync()
            if round_:
                best[i] = min(best[i], time.perf_counter() - start)
        round_ += 1
    return best


def matmul_seconds(device: str, rows: int, weights: list[torch.Tensor], dtypes: tuple[torch.dtype, ...],
                   repeats: int = 5, calls: int = 10) -> list[float]:
    """Seconds of one pass ``x @ W.T`` over all ``weights`` (each ``[n, k]``, ``x [rows, k]``
    random, the weights cache-resident: a compute rate), in each of ``dtypes``: the best of
    ``repeats`` rounds of ``calls`` passes, divided by ``calls``, timed interleaved (one round of
    each dtype and product in turn) so load changes hit all alike. Each dtype is timed with every
    product the engine could run it with and the fastest counts: ``F.linear`` on the plain weight;
    ``runtime.engines.products.linear`` on the weight packed once in oneDNN's blocked layout where
    oneDNN holds that dtype (CPU fp32, or bf16 with bf16 units); and for bf16, where the CPU
    kernels run their mixed product on AVX-512 BF16, on the weight packed for it. ``F.linear``
    reorders a bf16 weight on every call, so alone it understates what the CPU can do (on an AMD
    EPYC with AVX-512 BF16, one thread, ``[32, 576] @ [576, 3072]``: 235 GFLOP/s timed one call at a
    time through it, 411 packed)."""
    from runtime.engines import cpu_kernels
    from runtime.engines.products import kernel_products, linear, pack_weight

    dev = torch.device(device)
    kernels = None
    if dev.type == "cpu":
        try:
            kernels = cpu_kernels.load()
        except RuntimeError:  # no compiler: oneDNN and F.linear only
            pass
    x = torch.randn(rows, weights[0].shape[1], generator=torch.Generator().manual_seed(0))
    variants = []  # (dtype index, x, weights) for every product of every dtype
    for i, d in enumerate(dtypes):
        plain = [w.to(dev, d) for w in weights]
        variants.append((i, x.to(dev, d), plain))
        packed = [pack_weight(w, rows) for w in plain]
        if any(p is not w for p, w in zip(packed, plain)):
            variants.append((i, x.to(dev, d), packed))
        if kernel_products(kernels, d):
            variants.append((i, x.to(dev, d), [pack_weight(w, rows, kernels) for w in plain]))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def passes(xd, ws):
        for _ in range(calls):
            for w in ws:
                linear(xd, w, None)

    seconds = _interleaved_best([lambda xd=xd, ws=ws: passes(xd, ws) for _, xd, ws in variants], repeats, sync)
    best = [float("inf")] * len(dtypes)
    for (i, _, _), s in zip(variants, seconds):  # a dtype's fastest product
        best[i] = min(best[i], s / calls)
    return best
