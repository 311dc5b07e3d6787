"""Where a decode step of the embedded engine spends its time, and whether ``torch.compile``
of the layers' elementwise parts pays.

Breakdown: one decode step of ``rows`` sequences at position ``span - 1`` (random tokens,
after a prefill of ``span - 1`` random tokens a row) plus the draw of the next tokens, run
``--steps`` times; each section is timed with ``time.thread_time`` (CPU seconds of this
thread: a shared box's other jobs do not count, though they still slow memory and caches)
by wrapping the decoder's matrix products (``decoder.linear``), attention
(``F.scaled_dot_product_attention``), each function of ``runtime.engines.layer_ops`` and the
sampler; "other" is the rest of the step (cache writes, rotary tables, reshapes, the fp32
cast of the logits, Python). Wrappers cost ~1 us a call, not ``torch.profiler``'s ~20 us,
which inflated small ops roughly fivefold on this CPU.

``--compile``: the same step with every ``layer_ops`` function wrapped in
``torch.compile(dynamic=True)`` (inductor, C++ on CPU), against eager, interleaved (one step
of each per round, best of ``--steps``); prints the first call's wall time (the compile),
the logits' max difference and the number of graphs dynamo built after further steps at
other row counts and positions (it must not grow: no recompile per step).

Run: ``.venv/bin/python bench/engine_step_profile.py [--rows 32 64] [--dtype bfloat16] [--cpu-kernels off on] [--compile]``.
This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_flow.models.hf import load_model  # noqa: E402
from runtime.engines import decoder, layer_ops  # noqa: E402
from runtime.engines.sampling import sample  # noqa: E402

_OPS = ("rms_norm", "add_rms_norm", "rope_split", "silu_mul")


class _Forward:
    """The decoder's kernels with ``decode_attention`` an attribute of its own (so it can be timed)."""

    def __init__(self, kernels) -> None:
        self._kernels = kernels
        self.decode_attention = kernels.decode_attention

    def __getattr__(self, name):
        return getattr(self._kernels, name)


def _step(dec, ids, lengths, gen, kernels=None):
    logits = dec.decode(ids, lengths)
    return sample(logits, torch.ones(len(ids)), torch.ones(len(ids)), gen, kernels)


def _breakdown(dec, ids, lengths, steps: int) -> None:
    seconds = collections.Counter()
    inside = [False]  # a section calling another (add_rms_norm -> rms_norm) counts once, as itself

    def timed(name, fn):
        def run(*args, **kwargs):
            if inside[0]:
                return fn(*args, **kwargs)
            inside[0] = True
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.thread_time() - start
                inside[0] = False
        return run

    patches = [(decoder, "linear", "matrix products (layers)"),
               (decoder.F, "scaled_dot_product_attention", "attention (SDPA)"),
               *((dec.ops, name, name) for name in _OPS)]
    patches.append((dec, "_logits", "LM head"))  # fp32, bf16 or the mixed head, apart from the layers'
    kernels = dec.kernels  # the draw's kernel too (the engine passes it to sample)
    if dec.kernels is not None:  # gen.cpu_kernels: the decoder reaches the attention kernel as an attribute
        dec.kernels = _Forward(dec.kernels)
        patches[1] = (dec.kernels, "decode_attention", "attention (kernel)")
    saved = [getattr(mod, attr) for mod, attr, _ in patches]
    gen = torch.Generator().manual_seed(0)
    _step(dec, ids, lengths, gen, kernels)
    total = 0.0
    try:
        for mod, attr, name in patches:
            setattr(mod, attr, timed(name, getattr(mod, attr)))
        for _ in range(steps):
            start = time.thread_time()
            logits = dec.decode(ids, lengths)
            mid = time.thread_time()
            sample(logits, torch.ones(len(ids)), torch.ones(len(ids)), gen, kernels)
            seconds["sampling"] += time.thread_time() - mid
            total += time.thread_time() - start
    finally:
        for (mod, attr, _), fn in zip(patches, saved):
            setattr(mod, attr, fn)
    seconds["other"] = total - sum(seconds.values())
    print(f"decode step + draw: {total / steps * 1e3:.1f} ms CPU")
    for name, s in seconds.most_common():
        print(f"  {name:20s} {s / steps * 1e3:7.2f} ms  {s / total:6.1%}")


def _compiled_vs_eager(dec, ids, lengths, steps: int) -> None:
    from torch._dynamo.utils import counters

    eager = {name: getattr(layer_ops, name) for name in _OPS}
    compiled = {name: torch.compile(fn, dynamic=True) for name, fn in eager.items()}

    def run(fns):
        for name, fn in fns.items():
            setattr(layer_ops, name, fn)
        try:
            start = time.thread_time()
            logits = dec.decode(ids, lengths)
            return logits, time.thread_time() - start
        finally:
            for name, fn in eager.items():
                setattr(layer_ops, name, fn)

    ref, _ = run(eager)
    start = time.perf_counter()
    out, _ = run(compiled)
    print(f"compiled: first step {time.perf_counter() - start:.1f} s wall (compiling); "
          f"max |logit diff| to eager {(out - ref).abs().max().item():.2e}")
    best = {"eager": float("inf"), "compiled": float("inf")}
    for _ in range(steps):
        for name, fns in (("eager", eager), ("compiled", compiled)):
            best[name] = min(best[name], run(fns)[1])
    graphs = counters["stats"]["unique_graphs"]
    for cut in (1, 3):  # fewer rows, earlier positions: dynamic shapes, no new graph expected
        run_ids, run_len = ids[:-cut], lengths[:-cut] - cut
        for name, fn in compiled.items():
            setattr(layer_ops, name, fn)
        try:
            dec.decode(run_ids, run_len)
        finally:
            for name, fn in eager.items():
                setattr(layer_ops, name, fn)
    print(f"decode step: eager {best['eager'] * 1e3:.1f} ms, compiled {best['compiled'] * 1e3:.1f} ms CPU "
          f"(compiled / eager speed {best['eager'] / best['compiled']:.2f}x); dynamo graphs {graphs} -> "
          f"{counters['stats']['unique_graphs']} after steps at {len(ids) - 1} and {len(ids) - 3} rows")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--span", type=int, default=80, help="cache entries each row attends to")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cpu-kernels", nargs="+", default=["off", "on"],
                        help="gen.cpu_kernels values to profile, one after another")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd layer_ops")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, _ = load_model(args.model)
    dtype = getattr(torch, args.dtype)
    for rows in args.rows:
        for kernels in args.cpu_kernels:
            # the LM head as gen.lm_head_dtype=auto runs it: fp32 logits (for bf16 the mixed head where it runs)
            dec = decoder.KVDecoder(model, dtype, rows, torch.float32, cpu_kernels=kernels,
                                    mixed_head=None if dtype == torch.bfloat16 else False)
            dec.reserve(rows, args.span + 1)
            tokens = torch.randint(model.config.vocab_size, (rows, args.span), generator=torch.Generator().manual_seed(0))
            ids, lengths = tokens[:, -1], torch.full((rows,), args.span - 1)
            head = "mixed" if dec.mixed_head else "fp32"
            print(f"\n{args.model}, {args.dtype}, {rows} rows attending to {args.span} cache entries, 1 thread, "
                  f"gen.cpu_kernels={kernels}, LM head {head}")
            with torch.inference_mode():
                dec.prefill(tokens[:, :-1].tolist(), list(range(rows)))  # the cache of span - 1 random tokens a row
                _breakdown(dec, ids, lengths, args.steps)
                if args.compile:
                    _compiled_vs_eager(dec, ids, lengths, args.steps)


if __name__ == "__main__":
    main()
