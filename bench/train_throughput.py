"""Trainer tokens/s: padded vs packed micro-batches, fp32 vs bf16 autocast, side by side.

One GRPO optimizer step (``BaseAlgorithm.update_parameters``: forward, backward, AdamW) on a
batch whose response lengths are long-tailed (log-uniform between ``--min-response`` and
``--max-response`` tokens, after a ``--prompt``-token prompt that each group of ``--group``
rows shares, as GRPO's samples of one prompt do), in five micro-batch layouts:

* ``padded``: ``rows / 2`` sequences per micro-batch (``--micro-batch-size``) in batch order;
* ``padded+budget``: ``train.max_tokens_per_micro_batch``: rows sorted by length into
  micro-batches of at most the budget (rows x longest row);
* ``packed+budget``: the same budget, each micro-batch's sequences packed into one row
  (``train.pack_sequences``, ``train.shared_prefix=false``),
* ``packed+shared``: ``rows / 2`` sequences per micro-batch (the same), packed, each group's common prompt
  run once (``train.shared_prefix``, the default: ``areal_flow.algorithms.shared_prefix``),
* ``packed+shared+budget``: the same under the budget (clusters of rows sharing a prefix
  packed first-fit by the tokens they compute),

each in fp32 and under bf16 autocast (fp32 master weights and AdamW state, as the trainer
runs ``model.dtype=bfloat16``). Variants are interleaved round by round, so they share the
machine's load; tokens/s counts real tokens (prompt + response) and takes the fastest
round; "computed tokens" counts the positions the model runs, padding included. Run:
``python bench/train_throughput.py`` (``--models tiny-arith`` for a quick look). A published
shape (``--models tiny-arith,SmolLM2-135M``) is built in code with random weights (no model
file); ``--device cuda`` runs the steps on the GPU (autocast on CUDA).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from areal_flow.algorithms.micro_batches import plan_micro_batches
from areal_flow.algorithms.lookup import build_algorithm

LAYOUTS = {"padded": dict(), "padded+budget": dict(budget=True), "packed+budget": dict(budget=True, pack=True),
           "packed+shared": dict(pack=True, share=True), "packed+shared+budget": dict(budget=True, pack=True, share=True)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load(name: str) -> tuple[torch.nn.Module, int]:
    """The model ``name`` (a tiny preset, a published shape such as ``SmolLM2-135M`` built in
    code, or ``smollm2-135m``) in train mode, and its vocabulary size."""
    from areal_flow.models.tiny import build_in_code

    built = build_in_code(name)
    if built is not None:
        return built[0].train(), built[0].config.vocab_size
    from areal_flow.models.hf import load_model

    model, tokenizer = load_model(name)
    return model.train(), len(tokenizer)


def make_batch(rows: int, vocab: int, prompt: int, lo: int, hi: int, seed: int, group: int = 1) -> dict[str, torch.Tensor]:
    """A right-padded GRPO batch ``[rows, prompt + hi]``; response lengths log-uniform in [lo, hi];
    each ``group`` consecutive rows share their prompt tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(math.log(lo) + torch.rand(rows, generator=g) * (math.log(hi) - math.log(lo))).round().long()
    width = prompt + hi
    ids = torch.randint(4, vocab, (rows, width), generator=g)
    ids[:, :prompt] = ids[torch.arange(rows) // group * group, :prompt]
    attn = torch.zeros(rows, width, dtype=torch.long)
    loss_mask = torch.zeros(rows, width)
    for r, n in enumerate(lengths.tolist()):
        attn[r, : prompt + n] = 1
        loss_mask[r, prompt : prompt + n] = 1
    return {"input_ids": ids * attn, "attention_mask": attn, "loss_mask": loss_mask,
            "behavior_logprobs": -3.0 * loss_mask, "advantages": torch.randn(rows, 1, generator=g) * loss_mask}


def step_seconds(algo, batch: dict, layout: dict, budget: int, dtype: torch.dtype, device: str = "cpu") -> float:
    algo.max_tokens_per_micro_batch = budget if layout.get("budget") else 0
    algo.pack_sequences = bool(layout.get("pack"))
    algo.shared_prefix = bool(layout.get("share"))
    kind = torch.device(device).type
    sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.autocast(kind, dtype=dtype, enabled=dtype != torch.float32):
        algo.update_parameters(batch)
    sync()
    return time.perf_counter() - start


def bench(name: str, args) -> None:
    model, vocab = load(name)
    model = model.to(args.device)
    rows = args.rows_tiny if name.startswith("tiny") else args.rows_smollm2
    hi = min(args.max_response, model.config.max_position_embeddings - args.prompt)
    batch = {k: v.to(args.device) for k, v in make_batch(rows, vocab, args.prompt, args.min_response, hi,
                                                          args.seed, args.group).items()}
    lengths = batch["attention_mask"].sum(1)
    tokens = int(lengths.sum())
    budget = args.max_tokens or max(int(lengths.max()), math.ceil(tokens / 2))
    algo = build_algorithm("grpo", model, torch.optim.AdamW(model.parameters(), lr=1e-6),
                           micro_batch_size=args.micro_batch_size or math.ceil(rows / 2), max_grad_norm=1.0)
    variants = [(lay, dt) for dt in DTYPES for lay in LAYOUTS]
    for lay, dt in variants:  # warm-up (allocator, oneDNN primitives)
        step_seconds(algo, batch, LAYOUTS[lay], budget, DTYPES[dt], args.device)
    times = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            times[v].append(step_seconds(algo, batch, LAYOUTS[v[0]], budget, DTYPES[v[1]], args.device))
    print(f"\n{name}: {rows} sequences, {tokens} real tokens ({rows * int(lengths.max())} padded), "
          f"responses {args.min_response}..{hi} tokens log-uniform, groups of {args.group} sharing the prompt, budget {budget} tokens, "
          f"{args.rounds} interleaved rounds, {torch.get_num_threads()} threads, on {args.device}")
    base = min(times[("padded", "fp32")])
    print(f"{'layout':<21}{'dtype':<6}{'micro-batches':>14}{'computed tokens':>16}{'step s':>9}{'tokens/s':>10}"
          f"{'vs padded fp32':>16}")
    for lay, dt in variants:
        best = min(times[(lay, dt)])
        plan = plan_micro_batches(batch["attention_mask"], micro_batch_size=algo.micro_batch_size,
                                  max_tokens=budget if LAYOUTS[lay].get("budget") else 0,
                                  pack=bool(LAYOUTS[lay].get("pack")),
                                  input_ids=batch["input_ids"] if LAYOUTS[lay].get("share") else None)
        print(f"{lay:<21}{dt:<6}{len(plan):>14}{sum(mb.tokens for mb in plan):>16}{best:>9.2f}{tokens / best:>10.0f}"
              f"{base / best:>15.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny-arith,smollm2-135m")
    p.add_argument("--rows-tiny", type=int, default=32, help="sequences per step, tiny model")
    p.add_argument("--rows-smollm2", type=int, default=8, help="sequences per step, any model but a tiny one")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--group", type=int, default=8, help="consecutive rows sharing one prompt (GRPO's group size)")
    p.add_argument("--min-response", type=int, default=4)
    p.add_argument("--max-response", type=int, default=240)
    p.add_argument("--max-tokens", type=int, default=0,
                   help="micro-batch token budget; 0 = half the step's real tokens (at least the longest row)")
    p.add_argument("--micro-batch-size", type=int, default=0,
                   help="sequences per micro-batch of the layouts without a budget; 0 = half the rows")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="torch device of the model and batch (cpu, cuda)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        bench(name, args)


if __name__ == "__main__":
    main()
