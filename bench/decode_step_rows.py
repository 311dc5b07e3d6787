"""Benchmark (not a test): the embedded engine's decode-step time against its live rows.

Asynchrony gains on long-tailed responses what a synchronous batch loses while it empties:
the tail's decode steps, which cost nearly a full step when a step's time barely depends on
its rows (weight-read or tile bound, as on a GPU) and little when it is proportional to them.
This prints, for each model, engine dtype and torch thread count, the median time of one
``GenerationEngine.step`` with ``rows`` sequences decoding (1, 8, 16, 32, 64, 128 by
default) and ``step(max rows) / step(1 row)``: near 1 = flat, near ``max rows`` =
proportional. Every row decodes from a 7-token prompt; the timed steps start after
``--warm`` steps, so attention spans ``7 + warm`` to ``7 + warm + steps`` cached tokens.
Variants are interleaved round by round and the fastest round's median is kept (the box is
shared); random weights (timing only), EOS ignored, T = 1.

    python bench/decode_step_rows.py [--models tiny-s,tiny-arith] [--dtypes float32,bfloat16]
        [--threads 1,2] [--rows 1,8,16,32,64,128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_flow.models.presets import CHAR_VOCAB_SIZE  # noqa: E402
from areal_flow.models.tiny import build_model  # noqa: E402
from areal_flow.models.tokenizer import build_char_tokenizer  # noqa: E402
from runtime.engines.generation import GenerationEngine, GenerationRequest, SamplingParams  # noqa: E402


def step_ms(engine: GenerationEngine, prompt: list[int], rows: int, warm: int, steps: int, tag: str) -> float:
    """Median milliseconds of ``steps`` decode steps with ``rows`` live sequences, after
    ``warm`` steps (the first of them the prefill); the engine is idle again on return."""
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=warm + steps + 1, stop_at_eos=False)
    for i in range(rows):
        engine.submit(GenerationRequest(f"{tag}-{i}", prompt, params))
    for _ in range(warm):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_work():
        engine.step()
    return statistics.median(times) * 1e3


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny-s,tiny-arith,tiny-arith-wide", help="tiny presets")
    p.add_argument("--dtypes", default="float32,bfloat16", help="gen.dtype values")
    p.add_argument("--threads", default="1,2", help="torch thread counts")
    p.add_argument("--rows", default="1,8,16,32,64,128", help="live rows; the largest is the engine's slots")
    p.add_argument("--warm", type=int, default=40)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    tokenizer = build_char_tokenizer()
    prompt = tokenizer("17:81=")["input_ids"]
    engines = {(m, d): GenerationEngine(build_model(m, CHAR_VOCAB_SIZE), tokenizer, max_batch_size=max(rows), dtype=d)
               for m in args.models.split(",") for d in args.dtypes.split(",")}
    best: dict[tuple, float] = {}
    for round_ in range(args.rounds):
        for (m, d), engine in engines.items():
            for t in threads:
                torch.set_num_threads(t)
                for r in rows:
                    ms = step_ms(engine, prompt, r, args.warm, args.steps, f"{round_}-{t}-{r}")
                    best[m, d, t, r] = min(ms, best.get((m, d, t, r), ms))
    print(f"decode step, ms (median of {args.steps} steps, best of {args.rounds} interleaved rounds), by live rows")
    print(f"{'model':>16} {'dtype':>9} {'threads':>7} " + " ".join(f"{r:>7}" for r in rows) + "  max/1 row")
    for (m, d) in engines:
        for t in threads:
            ms = [best[m, d, t, r] for r in rows]
            print(f"{m:>16} {d:>9} {t:>7} " + " ".join(f"{v:7.2f}" for v in ms) + f"  {ms[-1] / ms[0]:8.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
