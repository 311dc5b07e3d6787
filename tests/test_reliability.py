"""Reliability (issue 13): late duplicates, failing rewards, versions, EOS ids, empty
responses, run folders. Hand-computed expectations; loopback only; seconds each."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from areal_flow.types import Trajectory
from areal_flow.values import Logprobs, Rewards, Rollouts
from runtime.staleness import OrderedExperienceBuffer
from runtime.groups import GroupItem, file_group

REPO = Path(__file__).resolve().parents[1]
TINY = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false"]
PLAN = SimpleNamespace(nodes=[SimpleNamespace(name="generate", grain="stream")])


def _traj(index: int, j: int, version: int = 0, text: str = "1") -> Trajectory:
    return Trajectory(f"{index}:{j}", index, [1], [5], [-0.5], [version], "stop", output_text=text,
                      meta={"answer": "1"})


def _item(index: int, n: int = 2) -> GroupItem:
    return GroupItem(index, 1, {"generate.rollouts": Rollouts([_traj(index, j) for j in range(n)])})


def test_a_late_duplicate_group_is_dropped_and_counted_held_or_trained():
    buffer, items, counts = OrderedExperienceBuffer(batch_groups=2, max_staleness=1), {}, {"duplicates": 0}
    assert file_group(_item(0), items, buffer, counts, PLAN)
    assert not file_group(_item(0), items, buffer, counts, PLAN)  # held: dropped
    assert file_group(_item(1), items, buffer, counts, PLAN)
    buffer.take_batch(0)  # indices 0 and 1 trained (the trainer pops them from items)
    items.clear()
    assert not file_group(_item(1), items, buffer, counts, PLAN)  # trained: dropped
    assert counts["duplicates"] == 2 and buffer.pending == 0


def _random_tiny(folder, eos=None):
    """tiny-arith with N(0, 0.3^2) weights (non-degenerate greedy tokens), saved to ``folder``
    with ``generation_config.eos_token_id = eos`` when given; loaded back as the runtime does."""
    import torch

    from areal_flow.models.tiny import build_model
    from areal_flow.models.tokenizer import build_char_tokenizer
    from runtime.model_source import load_pretrained

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_model("tiny-arith", len(tok), seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    if eos is not None:
        model.generation_config.eos_token_id = eos
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return load_pretrained(folder)


def test_every_eos_id_of_the_generation_config_stops_a_sequence(tmp_path):
    from runtime.engines.generation import GenerationEngine, GenerationRequest, SamplingParams, stop_token_ids

    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    model, tok = _random_tiny(tmp_path / "one")
    prompt = tok.encode("12+5=")
    plain = GenerationEngine(model, tok, max_batch_size=1).generate([GenerationRequest("a", prompt, greedy)])[0]
    first = plain.output_ids[0]
    assert tok.eos_token_id == 2 and first != 2 and len(plain.output_ids) > 1  # the control: it goes on
    model, tok = _random_tiny(tmp_path / "two", eos=[2, first])  # a second EOS id: the first greedy token
    engine = GenerationEngine(model, tok, max_batch_size=1)
    assert engine.eos_ids == {2, first} == stop_token_ids(tok, [2, first])
    out = engine.generate([GenerationRequest("b", prompt, greedy)])[0]
    assert out.output_ids == [first] and out.finish_reason == "stop"


def test_the_vllm_engine_reads_every_eos_id_of_the_folder(tmp_path):
    """vLLM gets them as ``stop_token_ids`` (``VLLMEngine._add``; the engine itself runs in
    ``make test-vllm``); here the folder reading both engines share."""
    from runtime.engines.generation import generation_config_eos, stop_token_ids

    _, tok = _random_tiny(tmp_path, eos=[7, 2])
    assert generation_config_eos(tmp_path) == [7, 2]
    assert stop_token_ids(tok, generation_config_eos(tmp_path)) == {2, 7}
    assert generation_config_eos(tmp_path / "nowhere") is None and stop_token_ids(tok, None) == {2}


# --- failing rewards -------------------------------------------------------------------------


def _reward(text: str, answer: str) -> float:
    """1.0 / 0.0 for "1" / "0"; "boom" raises, "nan" is non-finite, "hang" sleeps 3 s."""
    if text == "boom":
        raise ValueError("verifier crashed")
    if text == "hang":
        time.sleep(3.0)
    return float("nan") if text == "nan" else float(text)


def test_the_pool_classifies_every_call_and_abandons_a_hung_one():
    from areal_flow.rewards.pool import RewardPool

    pool = RewardPool(_reward, workers=2, timeout_s=0.3)
    started = time.monotonic()
    outcomes = pool.map([("1", ""), ("hang", ""), ("boom", ""), ("nan", ""), ("0", "")])
    assert time.monotonic() - started < 2.0  # the 3 s call did not hold the group
    assert [(o.value, o.kind) for o in outcomes] == [(1.0, ""), (None, "TimeoutError"), (None, "ValueError"),
                                                     (None, "non-finite"), (0.0, "")]
    assert "verifier crashed" in outcomes[2].detail and pool.abandoned == 1
    assert [o.value for o in pool.map([("1", ""), ("0", "")])] == [1.0, 0.0]  # a fresh thread replaced it


def test_the_monitor_logs_once_per_kind_and_stops_past_the_fraction(caplog):
    from areal_flow.rewards.pool import FailureFractionError, FailureMonitor, Outcome

    monitor = FailureMonitor("reward node 'reward' (fn f)", max_fraction=0.5, window=4)
    ok, boom = Outcome(value=1.0), Outcome(kind="ValueError", detail="Traceback...\nValueError: verifier crashed\n")
    with caplog.at_level(logging.ERROR, logger="areal_flow.rewards.pool"):
        # windows of the last 4 never hold more than 2 failures (not > 0.5 * 4 = 2): after 0:6 it is
        # 0:3..0:6 = ok, ok, boom, boom
        for i, outcome in enumerate([boom, ok, boom, ok, ok, boom, boom]):
            monitor.record(outcome, f"0:{i}")
        assert monitor.kinds == {"ValueError": 4}
        # 0:4..0:7 = ok, boom, boom, boom: 3 > 2
        with pytest.raises(FailureFractionError, match=r"^reward node 'reward' \(fn f\): 3 of the last 4 samples "
                                                       r"failed .*ValueError x5; first: sample 0:0: ValueError: "
                                                       r"verifier crashed$"):
            monitor.record(boom, "0:7")
    assert sum("first of its kind" in r.getMessage() for r in caplog.records) == 1


def _reward_node():
    from areal_flow.ops.reward import RewardExecutor

    node = SimpleNamespace(name="reward", model=None, attrs={"fn": _reward, "overlong": None, "timeout_s": 1.0,
                                                             "workers": 2, "max_failure_fraction": 1.0,
                                                             "failure_window": 100},
                           inputs={"rollouts": ("generate", "rollouts")})
    return node, RewardExecutor(node, SimpleNamespace(pad_id=0))


def test_failed_samples_leave_their_group_before_any_statistic():
    from runtime.groups import run_group_nodes

    node, executor = _reward_node()
    texts = ["1", "boom", "0", "1"]
    item = GroupItem(5, 1, {"generate.rollouts": Rollouts([_traj(5, j, text=t) for j, t in enumerate(texts)]),
                            "ref.logprobs": Logprobs([[-0.1], [-0.2], [-0.3], [-0.4]])})  # another node's per-sample value
    assert run_group_nodes(item, [node], {"reward": executor})
    kept = item.values["generate.rollouts"]
    assert [t.sample_id for t in kept] == ["5:0", "5:2", "5:3"]
    assert item.values["reward.rewards"] == Rewards([1.0, 0.0, 1.0])  # group mean 2/3, not (1 + 0 + 0 + 1) / 4
    assert item.values["ref.logprobs"] == Logprobs([[-0.1], [-0.3], [-0.4]])
    assert [t.meta["reward_failures"] for t in kept] == [1, 1, 1] and executor.monitor.kinds == {"ValueError": 1}


def test_a_group_with_no_sample_left_is_dropped_for_resampling():
    from runtime.groups import run_group_nodes

    node, executor = _reward_node()
    item = GroupItem(2, 1, {"generate.rollouts": Rollouts([_traj(2, j, text="nan") for j in range(3)])})
    assert not run_group_nodes(item, [node], {"reward": executor})
    assert executor.monitor.kinds == {"non-finite": 3}


def test_a_resampled_slots_prompt_is_its_slots_alone_and_never_runs_out():
    """Issue 26: runtime.spares' layout, slot (i, a) -> round (a - 2) div 3, position 3 i + (a - 2) mod 3."""
    from areal_flow.tasks.arithmetic import ArithmeticTask
    from runtime.spares import SparePrompts

    task = ArithmeticTask(seed=1)
    spares = SparePrompts(task, n_slots=4, per_slot=3, seed=1)
    round0, round1 = task.train_problems(12, seed=1 + 2), task.train_problems(12, seed=1 + 2 + 10_000)
    assert [spares(2, a) for a in (2, 3, 4, 5)] == [round0[6], round0[7], round0[8], round1[6]]
    assert spares(3, 2) == round0[9]
    assert spares(0, 9) == task.train_problems(12, seed=1 + 2 + 20_000)[1]  # 9 - 2 = 7 = 2 * 3 + 1: round 2, position 1
    resumed = SparePrompts(task, n_slots=4, per_slot=3, seed=1)  # a restarted router, asked in another order
    assert resumed(3, 2) == spares(3, 2) and resumed(2, 4) == spares(2, 4)
    with pytest.raises(ValueError, match=r"index 0, attempt 1: needs attempt >= 2 and 0 <= index < 4"):
        spares(0, 1)


def test_an_empty_response_is_left_out_and_counted():
    from areal_flow.rewards.pool import FailureMonitor
    from runtime.engines.generation import GenerationResult
    from runtime.executors.generate import drop_empty

    def result(rid, ids):
        return GenerationResult(rid, [1], ids, [-0.5] * len(ids), [0] * len(ids), "length", "", {})

    counts, monitor = {"empty_responses": 0}, FailureMonitor("generate node 'generate'", 0.5, 200)
    kept = drop_empty([result("0:0", [5, 2]), result("0:1", []), result("0:2", [2])], counts, monitor)
    assert [r.request_id for r in kept] == ["0:0", "0:2"] and counts == {"empty_responses": 1}
    assert monitor.kinds == {"empty response": 1}


FLAKY_GRAPH = """
import random

from areal_flow import Model, flow, ops


def flaky(output_text, answer):  # raises on about {p:.0%} of the samples
    if random.random() < {p}:
        raise ConnectionError("verifier unreachable")
    return 1.0 if output_text.strip() == answer else 0.0


@flow
def flaky_grpo(cfg):
    policy = Model("policy", cfg.model)
    rollout = ops.generate(policy, ops.dataset(cfg.dataset), n_samples=cfg.gen.n_samples,
                           max_new_tokens=cfg.gen.max_new_tokens)
    adv = ops.advantage(rollout, ops.reward(rollout, fn=flaky), estimator="grpo")
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats
"""


def _run_flaky(tmp_path: Path, p: float, *overrides: str) -> subprocess.CompletedProcess:
    graph = tmp_path / "flaky.py"
    graph.write_text(FLAKY_GRAPH.replace("{p:.0%}", f"{p:.0%}").replace("{p}", str(p)))
    return subprocess.run([sys.executable, "-m", "areal_flow.cli", "run", str(graph), "--config",
                           str(REPO / "graphs/arith_grpo.yaml"), *TINY, f"out_dir={tmp_path}", "name=flaky",
                           *overrides], cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_flaky_reward_never_reaches_the_loss(tmp_path, warm_cache):
    done = _run_flaky(tmp_path, 0.3, "reward.max_failure_fraction=1.0")
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "flaky/trajectories/trajectories.jsonl").read_text().splitlines()]
    groups: dict[int, list[dict]] = {}
    for r in records:
        groups.setdefault(r["group_id"], []).append(r)
    assert len(groups) == 3 * 2  # 3 steps x 2 groups: every slot filled, emptied groups resampled
    for members in groups.values():  # survivors only; each says how many of its 4 samples failed
        assert not any(r["meta"].get("reward_failed") for r in members)
        assert all(r["meta"].get("reward_failures", 0) == 4 - len(members) for r in members)
    assert done.stderr.count("ConnectionError on sample") <= 1  # logged once (if any failed at all)


@pytest.mark.slow
def test_a_reward_that_always_fails_stops_the_run_with_one_line(tmp_path, warm_cache):
    done = _run_flaky(tmp_path, 1.0, "reward.failure_window=8")
    assert done.returncode == 1
    # the 5th failure of a window of 8 exceeds 0.5 * 8 = 4
    line = next(x for x in done.stderr.splitlines() if "FailureFractionError" in x)
    assert line.startswith("generate/0 failed: FailureFractionError: reward node 'reward' (fn flaky): 5 of the last "
                           "5 samples failed (> max_failure_fraction 0.5 of a window of 8); so far ConnectionError x5")


# --- run folders ----------------------------------------------------------------------------


def test_a_rerun_starts_in_an_empty_folder_and_moves_the_earlier_one_aside(tmp_path):
    from runtime.run_dir import fresh_run_dir

    run = tmp_path / "exp"
    assert fresh_run_dir(run) is None and run.is_dir()  # first run: nothing to move
    assert fresh_run_dir(run) is None  # still empty: nothing to move
    (run / "events.out.tfevents.1").write_text("old")
    now = time.mktime((2025, 1, 2, 3, 4, 5, 0, 0, -1))  # local time 2025-01-02 03:04:05
    assert fresh_run_dir(run, now) == tmp_path / "exp.old-20250102-030405"
    assert list(run.iterdir()) == [] and (tmp_path / "exp.old-20250102-030405/events.out.tfevents.1").read_text() == "old"
    (run / "model").mkdir()
    assert fresh_run_dir(run, now) == tmp_path / "exp.old-20250102-030405-2"  # same second: a counter
    assert list(run.iterdir()) == []


def test_runs_of_one_name_do_not_mix(tmp_path, capsys):
    from areal_flow.cli import load_flow
    from areal_flow.config_load import load_config
    from compiler.program import compile_program
    from runtime.launch import RunSetup

    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*TINY, f"out_dir={tmp_path}", "name=same"])
    plan = compile_program(load_flow(REPO / "graphs/arith_grpo.py")(cfg), cfg)
    first = RunSetup.create(plan, show_progress=False).out_dir
    (first / "checkpoints").mkdir()
    (first / "events.out.tfevents.1").write_text("old")
    second = RunSetup.create(plan, show_progress=False).out_dir
    assert second == first and sorted(p.name for p in second.iterdir()) == ["commands.jsonl", "plan.json"]
    (old,) = tmp_path.glob("same.old-*")
    assert sorted(p.name for p in old.iterdir()) == ["checkpoints", "commands.jsonl", "events.out.tfevents.1",
                                                     "plan.json"]
    assert f"held an earlier run; moved it to {old.name}" in capsys.readouterr().err
