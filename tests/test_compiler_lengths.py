"""Response lengths and the generation time they imply, against hand arithmetic: the
distributions' quantiles, the decode-step cost, continuous batching without waves, and the
synchronous step waiting for its longest response while an asynchronous replica stays full."""

import math
import random

import numpy as np
import pytest

from areal_flow.config_compile import CompileConfigError, LengthDistConfig
from compiler.decode import ContinuousBatch, DecodeCost, DrainSchedule, drain_s
from compiler.hardware import GIB, DeviceSpec
from compiler.lengths import LengthDist
from compiler.models import ModelSpec, resolve_model
from compiler.strategy import ParallelStrategy
from compiler.timing import Links, generation_time

# Llama-2-7B shape: 6,738,415,616 parameters (tests/test_compiler_units.py)
LLAMA2_7B = ModelSpec("llama2-7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=32, head_dim=128,
                      vocab=32000, intermediate=11008)
LINKS = Links(DeviceSpec("unit", peak_flops=1e15, memory_bytes=80 * GIB, hbm_bandwidth=1e12,
                         intra_node_bandwidth=100e9, inter_node_bandwidth=10e9, host_bandwidth=10e9,
                         collective_latency_s=0.0), devices_per_node=8, efficiency=1.0)
W = 2 * 6_738_415_616 / 1e12  # s: the bf16 weights read once per step at 1e12 B/s = 0.013476831232
K = 2 * 32 * 32 * 128 * 2 / 1e12  # s per context token: 524,288 B of K and V = 5.24288e-7


def cost(prompt_len=0, overhead_s=0.0, samples_per_prompt=1):
    return DecodeCost.build(LLAMA2_7B, ParallelStrategy(), dtype="bf16", mfu=0.5, links=LINKS,
                            overhead_s=overhead_s, prompt_len=prompt_len, samples_per_prompt=samples_per_prompt)


def test_quantiles_of_each_shape():
    assert LengthDist(LengthDistConfig(kind="fixed", mean=0.5), 100).quantiles(3) == (50, 50, 50)
    # uniform on [1, 4] tokens: mid-quantiles 1/8, 3/8, 5/8, 7/8 -> 1.375, 2.125, 2.875, 3.625 -> 1, 2, 3, 4
    uniform = LengthDist(LengthDistConfig(kind="uniform", low=0.25, high=1.0), 4)
    assert uniform.quantiles(4) == (1, 2, 3, 4)
    # rounding [1, 4] to integers: 1 and 4 take 1/6 each, 2 and 3 1/3 each -> E[L] = 2.5;
    # mean age E[L(L-1)/2] / E[L] = (1/3 + 1 + 1) / 2.5 = 0.9333 (4096 grid points: within 1e-3)
    assert uniform.mean == pytest.approx(2.5, rel=1e-3)
    assert uniform.mean_age == pytest.approx((1 / 3 + 1 + 1) / 2.5, rel=1e-3)
    # lognormal, mean 0.35 of 1000 tokens, sigma 1: mu = ln 350 - 1/2; median e^mu = 212.3 tokens;
    # share at the cap P(L > 1000) = 1 - Phi((ln 1000 - mu) / 1) = 1 - Phi(1.5498) = 0.0606
    tail = LengthDist(LengthDistConfig(), 1000)
    assert tail.quantile(0.5) == round(350 * math.exp(-0.5))
    assert tail.clipped_fraction == pytest.approx(0.0606, abs=0.001)
    assert max(tail.sample(random.Random(0), 2000)) == 1000 and min(tail.quantiles(64)) >= 1
    with pytest.raises(CompileConfigError, match="compile.length_dist.kind"):
        LengthDist(LengthDistConfig(kind="pareto"), 10)
    with pytest.raises(CompileConfigError, match="compile.length_dist.low"):
        LengthDist(LengthDistConfig(kind="uniform", low=0.8, high=0.2), 10)


def test_decode_step_is_memory_bound_and_sums_in_closed_form():
    c = cost(overhead_s=0.002)
    # one response, no context: weights only (compute 2 x 6.738e9 FLOP / 5e14 = 2.7e-5 s, smaller) + 2 ms
    assert c.step_s(1, 0) == pytest.approx(W + 0.002)
    # 4 steps of 3 live responses from 30 context tokens: contexts 30, 33, 36, 39 -> 138 token-reads
    assert c.run_s(3, 30, 4) == pytest.approx(4 * (W + 0.002) + 138 * K)
    # prefill of 2 prompts of 10 tokens: 20 x (2 x 6,738,415,616 + 2 x 32 x 10 x 4096) FLOP / 5e14
    assert cost(prompt_len=10).prefill_s(2) == pytest.approx(20 * (2 * 6_738_415_616 + 2 * 32 * 10 * 4096) / 5e14)
    # 16 responses in groups of 8 sharing their prompt (the engines prefill it once): the same 2 prompts
    assert cost(prompt_len=10, samples_per_prompt=8).prefill_s(16) == \
        pytest.approx(20 * (2 * 6_738_415_616 + 2 * 32 * 10 * 4096) / 5e14)


def test_compute_bound_crossover_in_a_run():
    # 64 live responses on a slow-compute device: compute-bound at first (64 x 1.35e10 FLOP / 1e13 =
    # 86 ms > 13.5 ms of weights), memory-bound once the KV cache grows (K and V cost 524,288 B / 1e12
    # per token-read > 262,144 FLOP / 1e13): check run_s against the step-by-step sum
    slow = Links(DeviceSpec("slow", peak_flops=2e13, memory_bytes=80 * GIB, hbm_bandwidth=1e12,
                            intra_node_bandwidth=100e9, inter_node_bandwidth=10e9, host_bandwidth=10e9,
                            collective_latency_s=0.0), devices_per_node=8, efficiency=1.0)
    c = DecodeCost.build(LLAMA2_7B, ParallelStrategy(), dtype="bf16", mfu=0.5, links=slow, overhead_s=0.0,
                         prompt_len=0)
    mem = [(c.dense_bytes + c.kv_bytes * (64 * j)) / c.bandwidth for j in range(4000)]
    cmp = [(c.flops_token * 64 + c.flops_ctx * 64 * j) / c.compute for j in range(4000)]
    assert mem[0] < cmp[0] and mem[-1] > cmp[-1]  # the crossover lies inside the run
    assert c.run_s(64, 0, 4000) == pytest.approx(sum(map(max, mem, cmp)), rel=1e-12)


def test_sync_waits_for_the_longest_response_async_keeps_the_replica_full():
    # 4 responses of 1, 2, 3, 4 tokens (uniform on [1, 4]) on one replica with 4 slots, no prompt.
    dist = LengthDist(LengthDistConfig(kind="uniform", low=0.25, high=1.0), 4)
    kw = dict(n_sequences=4, prompt_len=0, lengths=dist, concurrent=4, dtype="bf16", mfu=0.5, links=LINKS,
              overhead_s=0.0)
    # k = 0, the batch drains: step 0: 4 live, context 0 -> W; step 1: 3 live of age 1 -> W + 3K;
    # step 2: 2 live of age 2 -> W + 4K; step 3: the longest alone, age 3 -> W + 3K. Total 4W + 10K.
    sync = generation_time(LLAMA2_7B, ParallelStrategy(), refill=False, **kw)
    assert sync["decode"] == pytest.approx(4 * W + 10 * K)
    # k >= 1, freed slots refilled: 4 x E[L] / 4 = 2.5 steps at 4 live responses of mean age 0.9333:
    # 2.5 x (W + 4 x 0.9333 K) = 2.5 W + 9.333 K. The weights are read 2.5 times instead of 4.
    full = generation_time(LLAMA2_7B, ParallelStrategy(), refill=True, **kw)
    assert full["decode"] == pytest.approx(2.5 * W + 2.5 * 4 * (7 / 3 / 2.5) * K, rel=1e-3)


def test_continuous_batching_bills_no_partial_wave():
    # 5 responses of 1, 1, 1, 1, 4 tokens, 4 slots: waves would bill 2 waves x 4 steps = 8 weight reads.
    # Continuous batching: step 0 with 4 live (the long one and three short ones; the fourth short
    # one waits), then the freed slots take it: step 1 with 2 live, steps 2-3 the long one alone:
    # 4 weight reads. Admission order is the golden-ratio shuffle of indices 0..4: 0, 3, 1, 4, 2,
    # so the long response (index 4) starts in the first batch.
    c = cost()
    seconds = drain_s(c, (1, 1, 1, 1, 4), slots=4)
    # contexts: step 0: 0; step 1: long age 1 + new short age 0 = 1; step 2: 2; step 3: 3 -> 6 token-reads
    assert seconds == pytest.approx(4 * W + 6 * K)
    # the engine the simulator uses gives the same time and finishing order
    engine = ContinuousBatch(c, slots=4)
    for rid in (0, 3, 1, 4, 2):
        engine.add((1, 1, 1, 1, 4)[rid], rid)
    finished = []
    while not engine.idle:
        finished += engine.advance()
    assert engine.clock == pytest.approx(seconds) and finished[-1] == 4 and sorted(finished) == [0, 1, 2, 3, 4]


def test_drain_schedule_by_hand():
    # the 5 responses above in 4 slots: step 0 with 4 live of age 0, step 1 with 2 live (the long
    # one of age 1, the late short one of age 0: 1 token), steps 2-3 the long one alone (age 2)
    partial = DrainSchedule.of((1, 1, 1, 1, 4), slots=4)
    assert (partial.responses, partial.batch.tolist(), partial.age.tolist(), partial.steps.tolist()) == (
        5, [4, 2, 1], [0, 1, 2], [1, 1, 2])
    # every response admitted at once: runs end at the distinct lengths 2 and 5;
    # 3 live for 2 steps, then the longest alone for 3 steps, holding its 2 generated tokens
    full = DrainSchedule.of((2, 2, 5), slots=8)
    assert (full.responses, full.batch.tolist(), full.age.tolist(), full.steps.tolist()) == (
        3, [3, 1], [0, 2], [2, 3])


def _step_by_step_drain(c, lengths, slots):
    """The drain by its definition, one decode step at a time (``step_s`` of the live batch
    and its context), admitting queued responses into freed slots in the golden-ratio order."""
    order = sorted(range(len(lengths)), key=lambda i: (i * (math.sqrt(5) - 1) / 2) % 1.0)
    queue, live, seconds = [lengths[i] for i in order], [], c.prefill_s(len(lengths))
    while queue or live:
        while queue and len(live) < slots:
            live.append([queue.pop(0), 0])  # [tokens left, tokens generated]
        context = sum(c.prompt_len + age for _, age in live)
        seconds += c.step_s(len(live), context) if any(left > 0 for left, _ in live) else 0.0
        live = [[left - 1, age + 1] for left, age in live if left > 1]
    return seconds


@pytest.mark.parametrize("spec", ["dense", "moe"])
def test_vectorised_drain_equals_its_definition(spec):
    # a dense replica on the slow-compute device of the crossover test (runs cross from compute- to
    # memory-bound) and Qwen3-30B-A3B (the experts a batch touches, min(1, b k / E), change with b)
    model = LLAMA2_7B if spec == "dense" else resolve_model("Qwen3-30B-A3B")
    slow = Links(DeviceSpec("slow", peak_flops=2e13, memory_bytes=80 * GIB, hbm_bandwidth=1e12,
                            intra_node_bandwidth=100e9, inter_node_bandwidth=10e9, host_bandwidth=10e9,
                            collective_latency_s=1e-6), devices_per_node=8, efficiency=1.0)
    c = DecodeCost.build(model, ParallelStrategy(tp=2), dtype="bf16", mfu=0.5, links=slow, overhead_s=1e-3,
                         prompt_len=7)
    rng = random.Random(3)
    for _ in range(12):
        lengths = tuple(sorted(rng.randint(1, 300) for _ in range(rng.randint(1, 40))))
        slots = rng.choice([1, 3, len(lengths), len(lengths) + 4])
        assert drain_s(c, lengths, slots) == pytest.approx(_step_by_step_drain(c, lengths, slots), rel=1e-9)
    # each run costed at once equals the scalar closed form bit for bit
    b, context, n = (np.array(v, dtype=np.int64) for v in zip(*[(rng.randint(1, 64), rng.randint(0, 10**5),
                                                                   rng.randint(1, 5000)) for _ in range(200)]))
    assert c.runs_s(b, context, n).tolist() == [c.run_s(*map(int, run)) for run in zip(b, context, n)]
