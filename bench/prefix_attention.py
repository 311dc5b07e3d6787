"""Benchmark: the decode-attention kernel with each row's copied prompt read from the row it was
copied from (``decode_attention``'s ``prefix_rows`` / ``prefix_lens``, what the engine passes,
``runtime.engines.prefill_plan.prefix_rows``) against every row reading its own copy.

One decode step's attention over every layer of a SmolLM2-135M-shaped cache (``--layers`` x
``[rows, kv heads, capacity, head dim]``, random contents: the kernel's time does not depend on
them), at each row count and context length: RL groups (``--group`` rows share a
``--prompt``-token prompt, each reading its group's first row) and distinct prompts sharing a
``--system``-token system turn (every row reading row 0's). Both calls in turn, best of
``--rounds``, one thread by default.

Run: ``.venv/bin/python bench/prefix_attention.py [--rows 32 64] [--contexts 61 93]``.
A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runtime.engines import cpu_kernels  # noqa: E402


def step_seconds(op, q, caches, lens, extra: tuple) -> float:
    """Seconds of one call per layer of ``caches`` (``[(keys, values)]``)."""
    start = time.perf_counter()
    for keys, values in caches:
        op(q, keys, values, lens, 0.125, *extra)
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[61, 93], help="tokens each row attends to")
    parser.add_argument("--group", type=int, default=8, help="rows sharing a prompt (a GRPO group)")
    parser.add_argument("--prompt", type=int, default=45, help="prompt tokens a group shares")
    parser.add_argument("--system", type=int, default=27, help="system-turn tokens distinct prompts share")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    op = cpu_kernels.load().decode_attention
    dtype = getattr(torch, args.dtype)
    cap = max(args.contexts) + 1
    print(f"decode attention, {args.layers} layers of [rows, {args.kv_heads}, {cap}, {args.head_dim}] {args.dtype}, "
          f"{args.group_size} query heads per KV head, {args.threads} thread(s), best of {args.rounds}")
    for rows in args.rows:
        caches = [(torch.randn(rows, args.kv_heads, cap, args.head_dim, dtype=dtype),
                   torch.randn(rows, args.kv_heads, cap, args.head_dim, dtype=dtype)) for _ in range(args.layers)]
        q = torch.randn(rows, args.kv_heads, args.group_size, args.head_dim, dtype=dtype)
        layouts = {f"groups of {args.group}, {args.prompt}-token prompt": (
                       torch.arange(rows) // args.group * args.group, args.prompt),
                   f"distinct prompts, {args.system}-token system turn": (torch.zeros(rows, dtype=torch.long),
                                                                         args.system)}
        for context in args.contexts:
            lens = torch.full((rows,), context - 1, dtype=torch.long)
            for name, (src, shared) in layouts.items():
                extra = (None, None, None, src, torch.full((rows,), min(shared, context - 1), dtype=torch.long))
                own = read = float("inf")
                for _ in range(args.rounds):
                    own = min(own, step_seconds(op, q, caches, lens, ()))
                    read = min(read, step_seconds(op, q, caches, lens, extra))
                print(f"rows {rows:3d}, context {context:4d}, {name}: own copies {own * 1e3:7.2f} ms, "
                      f"the source's {read * 1e3:7.2f} ms: {own / read:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
