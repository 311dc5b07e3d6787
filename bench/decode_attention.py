"""Benchmark: the embedded engine's decode attention, grouped queries (the engine's) against
``enable_gqa`` (keys and values repeated per query head inside SDPA), and their accuracy.

The decoder (``runtime.engines.decoder.KVDecoder.decode``) attends with each KV head's ``g``
query heads as one length-``g`` query of that head. This bench runs the same decode step
with the call rewritten to ``F.scaled_dot_product_attention(q [A, heads, 1, hd], ...,
enable_gqa=True)``, interleaved with the engine's own, best CPU time (``time.thread_time``)
of ``--rounds``, at each dtype and row count; then each bf16 variant's next-token
log-probs against the fp32 engine's on the same cache (expected |error| under the fp32
distribution, and the largest error on the fp32 top-1 token).

Run: ``.venv/bin/python bench/decode_attention.py [--model smollm2-135m] [--rows 32 64]``.
A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_flow.models.hf import load_model  # noqa: E402
from runtime.engines import decoder  # noqa: E402

_F = decoder.F


class _EnableGqa:
    """``torch.nn.functional`` with the decoder's grouped decode call made an ``enable_gqa`` one."""

    def __getattr__(self, name):
        return getattr(_F, name)

    @staticmethod
    def scaled_dot_product_attention(q, k, v, attn_mask=None, scale=None, **kwargs):
        if attn_mask is not None and q.shape[1] == k.shape[1] and q.shape[2] > 1:  # [A, kv, g, hd]
            a, kv, g, hd = q.shape
            out = _F.scaled_dot_product_attention(q.reshape(a, kv * g, 1, hd), k, v, attn_mask=attn_mask,
                                                  scale=scale, enable_gqa=True)
            return out.reshape(a, kv, g, hd)
        return _F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, **kwargs)


def _decoder(model, dtype, rows: int, span: int, seed: int):
    dec = decoder.KVDecoder(model, dtype, rows)
    dec.reserve(rows, span + 1)
    tokens = torch.randint(model.config.vocab_size, (rows, span), generator=torch.Generator().manual_seed(seed))
    dec.prefill(tokens[:, :-1].tolist(), list(range(rows)))
    return dec, tokens[:, -1], torch.full((rows,), span - 1)


def _decode(dec, ids, lengths, variant: str) -> torch.Tensor:
    decoder.F = _EnableGqa() if variant == "enable_gqa" else _F
    try:
        return dec.decode(ids, lengths)
    finally:
        decoder.F = _F


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--span", type=int, default=80, help="cache entries each row attends to")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, _ = load_model(args.model)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            for rows in args.rows:
                dec, ids, lengths = _decoder(model, dtype, rows, args.span, 0)
                best = {"grouped": float("inf"), "enable_gqa": float("inf")}
                for _ in range(args.rounds):
                    for variant in best:
                        start = time.thread_time()
                        _decode(dec, ids, lengths, variant)
                        best[variant] = min(best[variant], time.thread_time() - start)
                print(f"{str(dtype)[6:]:>8}, {rows} rows, {args.span} cache entries: grouped "
                      f"{best['grouped'] * 1e3:.1f} ms, enable_gqa {best['enable_gqa'] * 1e3:.1f} ms CPU a step "
                      f"-> grouped {best['enable_gqa'] / best['grouped']:.2f}x")
        rows = max(args.rows)
        ref = None
        for variant, dtype in (("fp32", torch.float32), ("grouped", torch.bfloat16), ("enable_gqa", torch.bfloat16)):
            dec, ids, lengths = _decoder(model, dtype, rows, args.span, 1)
            logp = torch.log_softmax(_decode(dec, ids, lengths, variant).float(), -1)
            if ref is None:
                ref = logp
                continue
            err = (logp - ref).abs()
            top = err.gather(1, ref.argmax(1, keepdim=True)).max()
            print(f"bf16 {variant}: next-token log-prob error vs fp32, expected {(ref.exp() * err).sum(-1).mean():.4f} "
                  f"nats, largest on the fp32 top-1 token {top:.4f} nats ({rows} rows)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
