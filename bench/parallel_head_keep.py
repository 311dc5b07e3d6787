"""The multi-rank trainer's forward + backward with the LM head on every column against the head
only from the step's first response column (``scored_from``), side by side, on 2 CPU ranks (gloo).

Each strategy (``--strategies``, e.g. ``d2`` FSDP, ``p2`` 1F1B pipeline, ``t2`` TP, ``c2`` Ulysses)
builds the policy through ``RankTrainer.build`` (the runner ``areal-flow run`` gives the algorithm)
from ``--model`` (a published shape built in code with random weights, e.g. ``SmolLM2-135M``, or a
tiny preset) and times ``runner.forward_backward`` over the step's micro-batches: ``--rows``
sequences of ``--prompt`` prompt and ``--response`` response tokens (the chat job's shape by
default: ``graphs/arith_chat_grpo``), split over the DP ranks, ``--micro-batch`` rows per
micro-batch, a GRPO-like token-sum loss (no entropy bonus). The two variants alternate round by
round (the order flipping each round), so they share the machine's load; a time is rank 0's
wall clock between two barriers. Run: ``python bench/parallel_head_keep.py`` (``--strategies p2
--rounds 1`` for a quick look). Prints the load average at each round.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import torch
import torch.distributed as dist

from areal_flow.algorithms.catalog import ALGORITHMS
from areal_flow.algorithms.micro_batches import plan_micro_batches
from areal_flow.models.tiny import build_in_code
from compiler.strategy import ParallelStrategy
from runtime.executors.train import TrainSettings
from runtime.parallel.launch import spawn_workers
from runtime.parallel_trainer import RankTrainer


def make_batch(rows: int, prompt: int, response: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """``[rows, prompt + response]`` token ids (no padding) and the response columns' loss mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, prompt + response), generator=g)
    loss_mask = torch.zeros(ids.shape)
    loss_mask[:, prompt:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


def _worker(rank: int, world_size: int, folder: str, text: str, batch: dict, args) -> dict[str, list[float]]:
    torch.set_num_threads(args.threads)
    loss = dataclasses.asdict(ALGORITHMS["grpo"].loss_config({}))
    spec = TrainSettings(model_folder=folder, algorithm="grpo", loss=loss, lr=1e-6, weight_decay=0.0, max_grad_norm=1.0,
                         micro_batch_size=args.micro_batch, temperature=1.0, seed=0)
    trainer = RankTrainer.build(spec, ParallelStrategy.parse(text))
    runner = trainer.algorithm.runner
    share = args.rows // trainer.strategy.dp
    start = trainer.parallel.coordinate["dp"] * share
    local = {k: v[start : start + share] for k, v in batch.items()}
    mask = local["loss_mask"]
    micro = plan_micro_batches(local["attention_mask"], micro_batch_size=args.micro_batch)
    n_tokens = float(batch["loss_mask"].sum())

    def loss_fn(mb, logp, entropy):
        return -(logp * mb.take(mask)).sum() / n_tokens

    def seconds(scored_from: int) -> float:
        dist.barrier()
        begin = time.perf_counter()
        runner.forward_backward(micro, local["input_ids"], local["attention_mask"], loss_fn, temperature=1.0,
                                entropy_grad=False, scored_from=scored_from)
        dist.barrier()
        trainer.algorithm.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - begin

    variants = {"every column": 0, "from the response": args.prompt}
    for scored_from in variants.values():  # warm-up: allocator, oneDNN primitives, the pipeline's schedules
        seconds(scored_from)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(seconds(variants[name]))
        if rank == 0:
            print(f"  [{text} round {round_ + 1}] " + "  ".join(f"{n}: {times[n][-1]:.2f} s" for n in variants)
                  + f"  load {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM2-135M")
    p.add_argument("--strategies", default="d2,p2", help="comma-separated 2-rank strategies")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt", type=int, default=45)
    p.add_argument("--response", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=16, help="rows per micro-batch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model, tokenizer = build_in_code(args.model)
    batch = make_batch(args.rows, args.prompt, args.response, model.config.vocab_size, args.seed)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del model
        print(f"{args.model}: {args.rows} rows of {args.prompt} prompt + {args.response} response tokens, "
              f"{args.micro_batch} rows per micro-batch, forward + backward, 2 ranks x {args.threads} threads (gloo), "
              f"{args.rounds} interleaved rounds, {os.cpu_count()} cores")
        for text in args.strategies.split(","):
            times = spawn_workers(_worker, 2, (folder, text, batch, args), backend="gloo", timeout_s=1800)[0]
            whole, part = min(times["every column"]), min(times["from the response"])
            print(f"{text}: every column {whole:.2f} s, from the response {part:.2f} s (fastest of each), "
                  f"{whole / part:.2f}x; rounds: {' '.join(f'{a:.2f}/{b:.2f}' for a, b in zip(*times.values()))}")


if __name__ == "__main__":
    main()
