"""Benchmark (not a test): measured peak memory per rank vs the compiler's prediction.

For one small Qwen2-shaped model and one batch, each strategy runs one full
training step (forward, backward, AdamW step, fp32) on CPU with gloo, one
spawn per strategy, and each rank reports:

- ``peak``: the growth of the process's peak resident set size
  (``getrusage(RUSAGE_SELF).ru_maxrss``, the kernel's high-water mark, so no
  short peak is missed) from just before the model is built to the end of the
  step. torch has no allocator statistics for CPU tensors (``torch.cpu`` has no
  ``memory_stats``; ``tracemalloc`` does not see them), hence RSS.
- ``states``: current RSS growth after the step: weights and AdamW moments
  alive, gradients freed by ``zero_grad()`` (set to ``None``), activations freed; read after ``gc.collect()`` and glibc's
  ``malloc_trim(0)`` so freed heap pages go back to the OS first.

The prediction is ``compiler.memory.training_memory`` (ZeRO/Korthikanti
formulas, see that module) for the same model, strategy, tokens and
micro-batches, with fp32 states (16 bytes/parameter).

What the measurement counts that the prediction does not: the full unsharded
model every rank builds before it is sharded (its pages stay in the peak),
allocator slack (glibc keeps freed heap pages), gloo and process-group
buffers, FSDP's all-gather/reduce-scatter buffers, DTensor redistribution
copies, the autograd graph's bookkeeping, and attention scores (the prediction
drops them, assuming FlashAttention; CPU SDPA may materialise them).
What the prediction counts that this run may not exhibit: bf16 mixed precision
is not used here (fp32 only), so its activation terms are scaled to 4 bytes.
Neither counts the Python interpreter and libraries loaded before the baseline;
code imported lazily on first use (e.g. by the first forward) does land in both
measured columns, which is the likely source of the ~17-23 MiB by which
``states`` exceeds its prediction for every strategy, the single process included.
On the logits: the prediction keeps 8 bytes per token and vocabulary entry (fp32
logits and their gradient); fp32 cross-entropy also materialises its log-softmax.

    python bench/memory_model.py                  # every strategy
    python bench/memory_model.py --strategy t2    # one (repeatable)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from compiler.memory import training_memory  # noqa: E402
from compiler.models import spec_from_config  # noqa: E402
from compiler.strategy import ParallelStrategy  # noqa: E402
from runtime.parallel.apply import ParallelConfig, parallelize  # noqa: E402
from runtime.parallel.launch import launch_strategy  # noqa: E402
from runtime.parallel.loss import shift_labels  # noqa: E402
from runtime.parallel.mesh import build_device_mesh  # noqa: E402
from runtime.parallel.train_step import shard_batch, train_step  # noqa: E402

MIB = 2**20
BATCH, SEQ = 8, 128
MODEL = dict(
    vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=False,
)
STRATEGIES = [
    ("d1", ParallelConfig()),
    ("d2", ParallelConfig()),
    ("t2", ParallelConfig()),
    ("p2", ParallelConfig(n_microbatches=2, pp_schedule="1f1b")),
    ("c2", ParallelConfig()),
    ("d2", ParallelConfig(activation_checkpointing=True)),
]


def _rss(trim: bool = False) -> int:
    if trim:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure(rank: int, world_size: int, strategy: ParallelStrategy, config: ParallelConfig) -> dict:
    """Worker: one training step; RSS growth (bytes) since before the model was built."""
    mesh = build_device_mesh(strategy, "cpu")
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=generator)
    labels = shift_labels(input_ids, torch.ones_like(input_ids))
    base_rss, base_peak = _rss(trim=True), _peak_rss()
    torch.manual_seed(0)
    model_config = Qwen2Config(**MODEL)
    model_config._attn_implementation = "sdpa"
    pm = parallelize(Qwen2ForCausalLM(model_config), strategy, mesh, config)
    optimizer = torch.optim.AdamW(pm.module.parameters(), lr=1e-4)
    train_step(pm, optimizer, *shard_batch(pm, input_ids, labels))
    # an upper bound if the high-water mark was reached before the baseline (then it is flagged)
    peak = _peak_rss()
    return {"peak": peak - base_rss, "states": _rss(trim=True) - base_rss, "old_peak": peak == base_peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", action="append", choices=sorted({text for text, _ in STRATEGIES}),
                        help="measure only this strategy (repeatable; default: all)")
    args = parser.parse_args()
    model_config = Qwen2Config(**MODEL)
    spec = spec_from_config(model_config.to_dict(), "bench-qwen2-tiny")
    print(f"model: {spec.n_params / 1e6:.2f} M params ({spec.n_params * 4 / MIB:.1f} MiB fp32), "
          f"batch {BATCH} x {SEQ} tokens, fp32, CPU/gloo; memory = RSS growth per rank (MiB)")
    print(f"{'strategy':<14}{'rank':>5}{'peak':>9}{'pred.total':>11}{'ratio':>7}{'states':>9}{'pred.states':>12}{'ratio':>7}")
    for text, config in STRATEGIES:
        if args.strategy and text not in args.strategy:
            continue
        strategy = ParallelStrategy.parse(text)
        predicted = training_memory(
            spec, strategy, tokens_per_step=BATCH * SEQ, micro_batches=config.n_microbatches, dtype="fp32",
            sharded=strategy.dp * strategy.cp > 1, checkpointing=config.activation_checkpointing,
        )
        states = predicted.weights + predicted.optimizer  # gradients are freed after the step
        started = time.perf_counter()
        per_rank = launch_strategy(measure, strategy, model_config, (strategy, config))
        label = text + ("+ac" if config.activation_checkpointing else "") + (f"/m{config.n_microbatches}" if config.n_microbatches > 1 else "")
        for rank, measured in enumerate(per_rank):
            print(
                f"{label:<14}{rank:>5}{measured['peak'] / MIB:>9.1f}{predicted.total / MIB:>11.1f}"
                f"{measured['peak'] / predicted.total:>7.2f}{measured['states'] / MIB:>9.1f}{states / MIB:>12.1f}"
                f"{measured['states'] / states:>7.2f}" + ("  (peak predates the step: upper bound)" if measured["old_peak"] else "")
            )
        print(f"{'':<14}(spawn + step {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
