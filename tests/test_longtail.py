"""The long-tail counting task (lengths, reward), non-interruptible weight updates, the
occupancy arithmetic of bench/async_vs_sync.py, and the longtail graph through the CLI."""

from __future__ import annotations

import importlib.util
import json
import statistics
from types import SimpleNamespace

import pytest

from areal_flow.tasks.catalog import build_task
from areal_flow.ops.reward import REWARD_FNS
from areal_flow.tasks.longtail import LongTailTask, count_weights
from runs import REPO, cli_run, records


def test_count_weights_are_the_truncated_zipf_law():
    # s = 1, max 3: weights 1, 1/2, 1/3 over H = 11/6.
    assert count_weights(3, 1.0) == pytest.approx([6 / 11, 3 / 11, 2 / 11])
    assert count_weights(4, 0.0) == pytest.approx([0.25] * 4)  # s = 0: uniform


@pytest.mark.parametrize("max_count, exponent", [(0, 1.0), (90, 1.0), (8, -0.5)])
def test_bad_parameters_are_refused(max_count, exponent):
    with pytest.raises(ValueError, match="max_count|exponent"):
        LongTailTask(max_count=max_count, exponent=exponent)


def test_problems_count_on_by_one_in_two_digit_numbers():
    problems = LongTailTask(seed=3).train_problems(2000, seed=0)
    assert [p["id"] for p in problems[:3]] == [0, 1, 2]
    for p in problems:
        a, b = (int(x) for x in p["prompt"].rstrip("=").split(":"))
        numbers = p["answer"].split(" ")
        assert 10 <= a < b <= 99 and b - a <= 64
        assert numbers[0] == str(a + 1) and numbers[-1] == str(b) and len(numbers) == b - a
        assert all(int(y) - int(x) == 1 for x, y in zip(numbers, numbers[1:]))
        assert len(p["answer"]) + 1 == 3 * (b - a)  # the answer tokens with EOS: 3n


def test_answer_tokens_with_the_char_tokenizer():
    from areal_flow.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    # "18 19 20 21": 11 characters + EOS = 12 tokens = 3 * 4; encode adds BOS, not EOS.
    assert len(tok.encode("18 19 20 21")) - 1 + 1 == 12
    assert LongTailTask().max_answer_tokens == 192


def test_count_distribution_has_the_long_tail():
    task = LongTailTask(seed=0)
    counts = [len(p["answer"].split(" ")) for p in task.train_problems(20_000, seed=5)]
    h = sum(k ** -1.1 for k in range(1, 65))  # truncated Zipf, s = 1.1, 1..64
    p1 = 1 / h  # 0.2505
    assert abs(counts.count(1) / len(counts) - p1) < 4 * (p1 * (1 - p1) / len(counts)) ** 0.5
    # P(n <= 4) = 0.497, P(n <= 5) = 0.539: the median count is 5 (15 tokens).
    assert statistics.median(counts) == 5
    assert max(counts) == 64 and min(counts) == 1
    # mean count sum_k k^-0.1 / H = 11.68 numbers (35 tokens): the longest is 5.5x the mean.
    mean = sum(k ** -0.1 for k in range(1, 65)) / h
    assert abs(statistics.fmean(counts) - mean) < 0.5


def test_test_set_is_fixed_and_disjoint_in_ids():
    task = LongTailTask(seed=2)
    assert task.test_set(50) == task.test_set(50)[:50] == task.test_set(80)[:50]
    assert task.test_set(3)[0]["id"] == 1_000_000_000
    assert task.test_set(20) != LongTailTask(seed=3).test_set(20)


@pytest.mark.parametrize("text, score", [("18 19 20", 1.0), (" 18 19 20<eos>9", 1.0), ("18 19 20 ", 1.0),
                                         ("18 19", 0.0), ("18 19 20 21", 0.0), ("18  19 20", 0.0), ("", 0.0),
                                         (None, 0.0)])
def test_reward_is_the_exact_sequence(text, score):
    assert LongTailTask.reward(text, "18 19 20") == score
    assert REWARD_FNS["longtail"](text, "18 19 20") == score


def test_a_dataset_node_names_the_task():
    task = build_task({"name": "longtail"}, seed=4)
    assert isinstance(task, LongTailTask) and task.spec()["seed"] == 4


def _executor(monkeypatch, interruptible: bool):
    """A generate executor over a tiny random model that never stops early (no EOS): 2 slots,
    groups of 2, 6 tokens each."""
    import runtime.executors.generate as generate
    from areal_flow.models.tiny import build_model
    from areal_flow.models.tokenizer import build_char_tokenizer
    from runtime.engines.generation import GenerationEngine

    tok = build_char_tokenizer()
    engine = GenerationEngine(build_model("tiny-s", len(tok)), tok, max_batch_size=2, seed=0)
    engine.eos_ids = frozenset()  # every response runs to max_new_tokens
    monkeypatch.setattr(generate, "build_engine", lambda node, ctx: engine)
    attrs = {"n_samples": 2, "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "interruptible": interruptible}
    return generate.GenerateExecutor(SimpleNamespace(attrs=attrs, name="generate"), SimpleNamespace(tokenizer=tok))


@pytest.mark.parametrize("interruptible", [True, False])
def test_weight_update_interrupts_or_waits_for_in_flight_responses(monkeypatch, interruptible):
    gen = _executor(monkeypatch, interruptible)
    gen.submit(0, 1, {"prompt": "12:14=", "answer": "13 14", "id": 0})
    assert gen.step() == [] and gen.step() == []  # group 0: 2 of 6 tokens
    assert gen.occupancy() == {"rows": 2, "slots": 2}
    gen.submit(1, 1, {"prompt": "20:21=", "answer": "21", "id": 1})
    state = {k: v.clone() for k, v in gen.engine.model.state_dict().items()}
    gen.update_weights(state, 1)
    finished = {}
    while gen.has_work():
        finished.update((index, trajs) for index, _, trajs in gen.step())
    first, second = finished[0], finished[1]
    # on: tokens 3-6 of group 0 come from version 1; off: group 0 finishes on version 0.
    assert [t.versions for t in first] == [[0, 0, 1, 1, 1, 1] if interruptible else [0] * 6] * 2
    assert [t.versions for t in second] == [[1] * 6] * 2


def _bench():
    spec = importlib.util.spec_from_file_location("async_vs_sync", REPO / "bench" / "async_vs_sync.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trace_span(proc: str, cat: str, ts: int, dur: int, name: str = "step", **args) -> dict:
    """A trace span as ``runtime.trace`` writes it (microseconds)."""
    return {"name": name, "proc": proc, "cat": cat, "ts": ts, "dur": dur, "args": args}


def _span(ts: int, dur: int, rows: int, slots: int = 4) -> dict:
    return {"ts": ts, "dur": dur, "proc": "generation/0", "cat": "node", "args": {"rows": rows, "slots": slots}}


def test_ideal_ratio_of_the_two_synchronous_runs_by_hand():
    bench = _bench()
    # One-thread run, engine steps of 4 slots: d = 1 ms + 0.5 ms per row: rows 4, 2, 1, 1 -> 3, 2, 1.5, 1.5 ms.
    steps = [_span(0, 3000, 4), _span(3000, 2000, 2), _span(5000, 1500, 1), _span(6500, 1500, 1)]
    r = bench.ideal_ratio(wall_s=0.020, gen_s=0.009, train_s=0.006, steps_1t=steps, gen_other_1t_s=0.001,
                          train_1t_s=0.008, n_steps=2)
    # All-cores run: O = 20 - 9 - 6 = 5 ms. One thread: G1 = 8 + 1 = 9 ms, R = 8 tokens, d(4) = 3 ms,
    # G1_full = 8 / 4 * 3 + 1 = 7 ms; T1 = 8 ms > G1_full: ideal = 8 + 7 / 2 + 5 = 16.5 ms.
    assert r["O"] == pytest.approx(0.005) and r["G1"] == pytest.approx(0.009) and r["tokens"] == 8
    assert r["step_full_s"] == pytest.approx(0.003) and r["G1_full"] == pytest.approx(0.007)
    assert r["ideal_async_s"] == pytest.approx(0.0165) and r["ideal_ratio"] == pytest.approx(20 / 16.5)
    # A trainer of 4 ms on one thread: generation is the longer stage, 7 + 4 / 2 + 5 = 14 ms.
    r = bench.ideal_ratio(wall_s=0.020, gen_s=0.009, train_s=0.006, steps_1t=steps, gen_other_1t_s=0.001,
                          train_1t_s=0.004, n_steps=2)
    assert r["ideal_async_s"] == pytest.approx(0.014) and r["ideal_ratio"] == pytest.approx(20 / 14)
    with pytest.raises(ValueError, match="n_steps"):
        bench.ideal_ratio(0.02, 0.009, 0.006, [], 0.001, 0.004, 2)


def test_busy_times_count_nested_spans_once():
    bench = _bench()
    # [0, 10) holds [2, 5); [8, 12) overlaps it; [20, 25) is apart: 12 + 5 = 17 us.
    assert bench.union_seconds([{"ts": 0, "dur": 10}, {"ts": 2, "dur": 3}, {"ts": 8, "dur": 4},
                                {"ts": 20, "dur": 5}]) == pytest.approx(17e-6)

    gen, train = "generation/0", "train_step/0"
    spans = [_trace_span(gen, "node", 0, 3000, rows=4, slots=4), _trace_span(gen, "node", 3000, 2000, rows=2, slots=4),
             _trace_span(gen, "node", 5000, 1000), _trace_span(gen, "edge", 0, 10000),
             _trace_span(train, "node", 6000, 4000), _trace_span(train, "phase", 6000, 1000, phase="forward"),
             _trace_span(train, "phase", 7000, 2500, phase="backward"), _trace_span("driver", "node", 0, 9000),
             _trace_span(train, "io", 10000, 3000, name="checkpoint")]
    # E: the reward span, 1 ms (engine steps and the edge wait excluded); T: the train step's
    # 4 ms, its phases inside it not added again (a plain sum would give 7.5 ms), its 3 ms
    # checkpoint write left out (4 + 3 = 7 ms if counted).
    assert bench.busy_times(spans, "generation/0") == pytest.approx((0.001, 0.004))


def test_loop_window_leaves_out_the_generators_wait_for_a_late_trainer():
    bench = _bench()

    # Generator steps at [100, 300) and [300, 400), then idle until the trainer's first span at
    # 1000 (its model was loading); the router's admission track starts at 50, before the loop.
    spans = [_trace_span("edge dataset->generate", "edge", 50, 100),
             _trace_span("generate/0", "node", 100, 200, rows=2, slots=2),
             _trace_span("generate/0", "node", 300, 100, rows=1, slots=2),
             _trace_span("train_step/0", "edge", 1000, 500), _trace_span("train_step/0", "node", 1500, 300)]
    # waited = (1000 - 100) - 300 busy = 600 us; the loop is [100, 1800) less 600 us = 1.1 ms.
    assert bench.loop_window(spans, "generate/0", 100) == (100, 1800, pytest.approx(600e-6))
    # A trainer that was ready before the first step costs no wait.
    early = [{**s, "ts": 20} if s["proc"] == "train_step/0" and s["cat"] == "edge" else s for s in spans]
    assert bench.loop_window(early, "generate/0", 100)[2] == pytest.approx(0.0)


def test_occupancy_bins_by_hand():
    bench = _bench()
    # 4 slots over [0, 40): steps [0, 10) at 4 rows and [10, 15) at 2 rows, then idle.
    bins = bench.occupancy_bins([_span(0, 10, 4), _span(10, 5, 2)], 0, 40, bins=4)
    assert bins == pytest.approx([1.0, 0.25, 0.0, 0.0])
    assert bench.sparkline(bins) == "9200"


@pytest.mark.slow
def test_longtail_graph_runs_two_steps_through_the_cli(tmp_path):
    # threads_per_worker=3: no automatic value on this 2-core box (k=0: 2 threads; k>=1: 1)
    cli_run(REPO / "graphs" / "longtail_grpo.py", "train.steps=2", "train.batch_size=2", "gen.n_samples=2",
            "eval.enabled=false", "warm_start.steps=20", "gen.max_new_tokens=24", f"out_dir={tmp_path}",
            "async.max_staleness=0", "scheduler.threads_per_worker=3", "debug.record=[advantage->train_step]")
    out = tmp_path / "longtail_grpo"
    assert json.loads((out / "record" / "advantage-train_step" / "meta.json").read_text())["threads"] == 3
    assert len(records(out)) == 2 * 2 * 2  # steps x groups x samples
    spans = [json.loads(line) for f in (out / "trace").glob("*.jsonl") for line in f.read_text().splitlines()]
    engine = [s for s in spans if "rows" in s["args"]]
    assert engine and all(1 <= s["args"]["rows"] <= s["args"]["slots"] for s in engine)
