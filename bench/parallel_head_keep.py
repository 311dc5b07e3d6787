"""The trainer's passes with the LM head on every column against the head only from the step's
first response column (``scored_from``), side by side: on 2 CPU ranks (gloo) or in one process.

Each strategy (``--strategies``, e.g. ``d2`` FSDP, ``p2`` 1F1B pipeline, ``t2`` TP, ``c2`` Ulysses)
builds the policy through ``RankTrainer.build`` (the runner ``areal-flow run`` gives the algorithm)
from ``--model`` (a published shape built in code with random weights, e.g. ``SmolLM2-135M``, or a
tiny preset); ``one`` runs the one-process ``ModelRunner`` (the default trainer's) on ``--threads``
threads, as one rank (at load 9 on this 2-core box 2 threads ran a tiny model's pass 50-100x
slower than 1). It times one pass (``--pass``) over the step's micro-batches: ``forward-backward``
(``runner.forward_backward``, a GRPO-like token-sum loss, no entropy bonus) or ``logprobs``
(``runner.logprobs``: the no-grad log-prob pass of M2PO's proximal policy and the reference
model), on ``--rows`` sequences of ``--prompt`` prompt and ``--response`` response tokens (the
chat job's shape by default: ``graphs/arith_chat_grpo``), split over the DP ranks,
``--micro-batch`` rows per micro-batch, in each of ``--dtypes`` (fp32, or bf16 autocast over the
fp32 weights as ``model.dtype=bfloat16`` trains). The variants (dtype x head) alternate round by
round (the order flipping each round), so they share the machine's load; a time is rank 0's wall
clock between two barriers, and the CPU time of every rank's process summed
(``time.process_time``: the steadier figure on a loaded box, as a shared core's wall clock counts
the other jobs' turns). Run: ``python bench/parallel_head_keep.py`` (``--strategies p2 --rounds
1`` for a quick look; ``--pass logprobs --strategies one,d2,p2 --dtypes fp32,bf16`` for the
log-prob pass). Prints the load average at each round (with rank 0's own CPU time).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from areal_flow.algorithms.catalog import ALGORITHMS
from areal_flow.algorithms.micro_batches import plan_micro_batches
from areal_flow.algorithms.model_runner import ModelRunner
from areal_flow.models.tiny import build_in_code
from compiler.strategy import ParallelStrategy
from runtime.executors.train_settings import TrainSettings
from runtime.parallel.launch import spawn_workers
from runtime.parallel_trainer import RankTrainer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADS = ("every column", "from the response")


def make_batch(rows: int, prompt: int, response: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """``[rows, prompt + response]`` token ids (no padding) and the response columns' loss mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, prompt + response), generator=g)
    loss_mask = torch.zeros(ids.shape)
    loss_mask[:, prompt:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


def timed_rounds(runner: ModelRunner, model: torch.nn.Module, local: dict, n_tokens: float, args, text: str,
                 sync: Callable[[], None], verbose: bool) -> dict[str, list[tuple[float, float]]]:
    """``(wall, CPU)`` seconds of ``args.pass_`` over ``local``'s rows (``[rows, T]`` tensors) per
    variant ``"<dtype>, <head>"``, one list entry per round, after one warm-up call of each variant
    (allocator, oneDNN primitives, the pipeline's schedules); ``sync`` brackets each call."""
    micro = plan_micro_batches(local["attention_mask"], micro_batch_size=args.micro_batch)
    ids, attn, mask = local["input_ids"], local["attention_mask"], local["loss_mask"]

    def loss_fn(mb, logp, entropy):
        return -(logp * mb.take(mask)).sum() / n_tokens

    def seconds(dtype: torch.dtype, scored_from: int) -> tuple[float, float]:
        sync()
        begin, begin_cpu = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            if args.pass_ == "logprobs":
                runner.logprobs(micro, ids, attn, 1.0, scored_from)
            else:
                runner.forward_backward(micro, ids, attn, loss_fn, temperature=1.0, entropy_grad=False,
                                        scored_from=scored_from)
        sync()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - begin, time.process_time() - begin_cpu

    variants = {f"{name}, {head}": (DTYPES[name], scored_from) for name in args.dtypes.split(",")
                for head, scored_from in zip(HEADS, (0, args.prompt))}
    for variant in variants.values():
        seconds(*variant)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        for name in list(variants) if round_ % 2 == 0 else list(reversed(variants)):
            times[name].append(seconds(*variants[name]))
        if verbose:
            last = "  ".join(f"{n}: {times[n][-1][0]:.2f} s (this process {times[n][-1][1]:.2f} s CPU)"
                             for n in variants)
            print(f"  [{text} round {round_ + 1}] {last}  load {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
                  flush=True)
    return times


def _worker(rank: int, world_size: int, folder: str, text: str, batch: dict,
            args) -> dict[str, list[tuple[float, float]]]:
    torch.set_num_threads(args.threads)
    loss = dataclasses.asdict(ALGORITHMS["grpo"].loss_config({}))
    spec = TrainSettings(model_folder=folder, algorithm="grpo", loss=loss, lr=1e-6, weight_decay=0.0, max_grad_norm=1.0,
                         micro_batch_size=args.micro_batch, temperature=1.0, seed=0)
    trainer = RankTrainer.build(spec, ParallelStrategy.parse(text))
    share = args.rows // trainer.strategy.dp
    start = trainer.parallel.coordinate["dp"] * share
    local = {k: v[start : start + share] for k, v in batch.items()}
    return timed_rounds(trainer.algorithm.runner, trainer.parallel.module, local, float(batch["loss_mask"].sum()),
                        args, text, dist.barrier, rank == 0)


def report(text: str, times: dict[str, list[tuple[float, float]]]) -> None:
    """Per dtype and clock (wall, CPU): the fastest round of each head, their ratio, every round's pair."""
    for name in dict.fromkeys(variant.split(", ")[0] for variant in times):
        for clock, label in enumerate(("wall", "CPU")):
            whole, part = ([t[clock] for t in times[f"{name}, {head}"]] for head in HEADS)
            rounds = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(whole, part))
            print(f"{text} {name} {label}: every column {min(whole):.2f} s, from the response {min(part):.2f} s "
                  f"(fastest of each), {min(whole) / min(part):.2f}x; rounds: {rounds}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM2-135M")
    p.add_argument("--strategies", default="d2,p2", help="comma-separated 2-rank strategies, or one (one process)")
    p.add_argument("--pass", dest="pass_", choices=("forward-backward", "logprobs"), default="forward-backward")
    p.add_argument("--dtypes", default="fp32", help="comma-separated: fp32, bf16 (autocast)")
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
    print(f"{args.model}: {args.rows} rows of {args.prompt} prompt + {args.response} response tokens, "
          f"{args.micro_batch} rows per micro-batch, {args.pass_}, {args.dtypes}, 2 ranks x {args.threads} threads "
          f"(gloo) or one process, {args.rounds} interleaved rounds, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        for text in args.strategies.split(","):
            if text == "one":
                torch.set_num_threads(args.threads)
                times = timed_rounds(ModelRunner(model), model, batch, float(batch["loss_mask"].sum()), args, text,
                                     lambda: None, True)
            else:
                ranks = spawn_workers(_worker, 2, (folder, text, batch, args), backend="gloo", timeout_s=1800)
                times = {name: [(wall, sum(rank[name][i][1] for rank in ranks))  # rank 0's wall, all ranks' CPU
                                for i, (wall, _) in enumerate(ranks[0][name])] for name in ranks[0]}
            report(text, times)


if __name__ == "__main__":
    main()
