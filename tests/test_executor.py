"""The plan is the program: any graph runs as the plan places it (``runtime.topology``,
``runtime.router``, ``runtime.workers``).

* a node kind defined here, in the test file, runs with no edit to ``runtime/``;
* a saved ``plan.json`` edited by hand (k, micro-batches, generation replicas) is what runs;
* the reference + reward model + filter graph runs with two generation replicas, with the
  same accounting as with one: every sample trained exactly once, in its step's slot, with
  staleness <= k;
* PPO's critic is a train_step node of its own, trained in the trainer's worker group.
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from areal_flow import Model, flow, ops
from areal_flow.config_load import load_config
from areal_flow.ops import register_op
from areal_flow.tasks.arithmetic import ArithmeticTask
from compiler.plan import Plan
from areal_flow.cli.run import run_experiment
from runtime.topology import build_topology
from runs import records as trained_records

REPO = Path(__file__).resolve().parents[1]
TINY = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false"]
COEF = 0.25


@register_op("length_penalty", inputs={"rollouts": "rollouts", "rewards": "rewards"}, outputs={"rewards": "rewards"})
def length_penalty(rollouts, rewards, coef=0.0):
    """A user node between reward and advantage: ``r - coef * response tokens``."""
    return [r - coef * len(t.output_ids) for t, r in zip(rollouts, rewards)]


@flow
def grpo_with_penalty(cfg):
    policy = Model("policy", cfg.model)
    rollout = ops.generate(policy, ops.dataset(cfg.dataset), n_samples=cfg.gen.n_samples,
                           max_new_tokens=cfg.gen.max_new_tokens)
    penalized = length_penalty(rollout, ops.reward(rollout, fn="arithmetic"), coef=COEF)
    adv = ops.advantage(rollout, penalized, estimator="grpo")
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats


def _exactly_once(out: Path, steps: int, batch: int, n: int, k: int) -> list[dict]:
    records = trained_records(out)
    ids = [r["sample_id"] for r in records]
    assert len(ids) == steps * batch * n == len(set(ids))
    assert Counter(r["group_id"] for r in records) == {i: n for i in range(steps * batch)}
    assert all(r["step"] == r["group_id"] // batch for r in records)  # index i trained at step i // B
    assert all(r["step"] - min(r["versions"]) <= k for r in records)
    return records


def _scalars(out: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(out / "events*"))[-1])
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


def test_user_op_is_in_the_plan_and_the_topology():
    cfg = load_config(REPO / "graphs/arith_grpo.yaml", TINY)
    from compiler.program import compile_program

    plan = compile_program(grpo_with_penalty(cfg), cfg)
    node = plan.node("length_penalty")
    assert (node.grain, node.placed_with, node.inputs["rewards"]) == ("group", "generate", ["reward", "rewards"])
    assert "length_penalty" in plan.ops  # the definition travels with the plan
    assert build_topology(plan).generation.nodes == ["generate", "reward", "length_penalty"]


@pytest.fixture(scope="module")
def penalty_run(tmp_path_factory):
    """``(run folder, config)`` of one run of :func:`grpo_with_penalty` (a user op defined
    here), with the observability knobs on (``eval.every``, ``debug.memory_profiler``): the
    user-op test and the observability test read it (neither knob changes what is sampled or
    trained: the mid-run evaluation and the memory profile are the trainer's, between steps)."""
    tmp = tmp_path_factory.mktemp("penalty")
    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*TINY, f"out_dir={tmp}", "name=penalty", "eval.every=1",
                                                        "eval.n_test=10", "debug.memory_profiler=true"])
    run_experiment(grpo_with_penalty(cfg), cfg, show_progress=False)
    return tmp / "penalty", cfg


@pytest.mark.slow
@pytest.mark.ci
def test_user_op_defined_in_a_test_file_runs(penalty_run):
    out, _ = penalty_run
    records = _exactly_once(out, 3, 2, 4, k=2)
    right: dict[int, list[bool]] = {}
    for r in records:  # the trained reward is the rule's minus the penalty, by hand from the sample
        rule = ArithmeticTask.reward(r["output_text"], r["meta"]["answer"])
        assert r["reward"] == pytest.approx(rule - COEF * len(r["output_ids"]))
        right.setdefault(r["step"], []).append(rule == 1.0)
    # accuracy counts right answers although no penalized reward is 1.0 (it read 0.00 before)
    assert _scalars(out, "rl/accuracy") == pytest.approx([sum(v) / len(v) for _, v in sorted(right.items())])


@pytest.mark.slow
@pytest.mark.ci
def test_an_edited_plan_is_what_runs(tmp_path, warm_cache):
    """Compile, then edit k (2 -> 0), the train_step's micro-batches (1 -> 2) and the
    allocation (one generation replica -> two) in plan.json; ``run --plan`` follows it."""
    plan_path = tmp_path / "plan.json"
    cli = [sys.executable, "-m", "areal_flow.cli"]
    subprocess.run([*cli, "compile", "graphs/arith_grpo.py", *TINY, f"out_dir={tmp_path}", "--plan", "-o",
                    str(plan_path)], cwd=REPO, check=True, capture_output=True)
    data = json.loads(plan_path.read_text())
    assert data["cluster"]["n_gpus_per_node"] == 2
    data["cluster"]["n_gpus_per_node"] = 3
    for node in data["nodes"]:
        if node["name"] == "generate":
            node["strategy"] = "d2"
        if node["mesh"]["first_device"] == 0:  # generate and the nodes placed with it
            node["mesh"]["n_devices"] = 2
        elif node["mesh"]["first_device"] == 1:  # the trainer's mesh moves to device 2
            node["mesh"]["first_device"] = 2
        if node["name"] == "train_step":
            assert node["micro_batches"] == 1
            node["micro_batches"] = 2
    for edge in data["edges"]:
        if edge["dst"] == "train_step" and edge["kind"] == "data":
            assert edge["max_staleness"] == 2
            edge["max_staleness"] = 0
    plan_path.write_text(json.dumps(data))
    Plan.from_json(plan_path.read_text())  # still a valid plan
    done = subprocess.run([*cli, "run", "--plan", str(plan_path)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "arith_grpo"
    records = _exactly_once(out, 3, 2, 4, k=0)
    assert all(r["staleness"] == 0 for r in records)  # k = 0: the synchronous baseline
    summary = json.loads((out / "summary.json").read_text())
    assert {"generate/0", "generate/1"} <= set(summary["workers"])  # two replicas ...
    assert summary["workers"]["generate/0"]["groups"] + summary["workers"]["generate/1"]["groups"] == 6
    assert _scalars(out, "train/micro_batch_size") == [4.0] * 3  # 2 groups x 4 samples in 2 micro-batches


def _ref_rm(tmp_path: Path, name: str, *overrides: str):
    from areal_flow.cli import load_flow

    fl = load_flow(REPO / "graphs/arith_grpo_ref_rm.py")
    cfg = load_config(REPO / "graphs/arith_grpo_ref_rm.yaml",
                      [*TINY, "model.path=tiny-s", "reward.model_steps=10", f"out_dir={tmp_path}", f"name={name}",
                       *overrides])
    return run_experiment(fl(cfg), cfg, show_progress=False)


@pytest.mark.slow
@pytest.mark.ci
def test_ref_rm_filter_graph_with_two_generation_replicas(tmp_path, warm_cache):
    two = _ref_rm(tmp_path, "two", "cluster.n_gpus_per_node=3", "compile.allocation=gen:d2 + train:d1")
    one = _ref_rm(tmp_path, "one")
    for name, summary in (("two", two), ("one", one)):
        records = _exactly_once(tmp_path / name, 3, 2, 4, k=2)
        assert all(0.0 <= r["reward"] <= 1.0 for r in records)  # sigmoid of the reward model's score
        assert all(len({x["reward"] for x in records if x["group_id"] == g}) > 1 for g in range(6))  # filter
        assert summary["samples_trained"] == 24
    assert {w for w in two["workers"] if w.startswith("generate/")} == {"generate/0", "generate/1"}
    assert all(v > -1e9 for v in _scalars(tmp_path / "two", "train/kl_ref_in_reward"))


def test_a_critic_train_step_on_several_processes_joins_the_policy_ranks_or_has_its_own():
    """A dN critic on the policy train_step's mesh joins its worker group (its ranks:
    ``test_parallel_critic``), and so does a tN one; on a multi-rank mesh of its own it is a
    worker group of its own with its advantage node (its ranks: ``test_own_mesh``); under pp with tp the one predicate's rule ``critic-parallel``
    (compiler.executable) refuses it at compile and, for a hand-edited plan, before a run starts."""
    import dataclasses

    from areal_flow.cli import load_flow
    from compiler import AllocationError
    from compiler.executable import ExecutableError
    from compiler.program import compile_program
    from runtime.preflight import check_runnable

    fl = load_flow(REPO / "graphs/arith_ppo.py")
    cfg = load_config(REPO / "graphs/arith_ppo.yaml",
                      [*TINY, "cluster.n_gpus_per_node=4", "compile.allocation=train:d2 | critic_step:d2 + gen:d1"])
    group = build_topology(compile_program(fl(cfg), cfg)).groups["train_step"]
    assert {"train_step", "critic_step"} <= set(group.nodes) and group.strategy.short() == "d2"
    cfg = load_config(REPO / "graphs/arith_ppo.yaml",
                      [*TINY, "cluster.n_gpus_per_node=8", "compile.allocation=critic_step:d2 + train:d2 + gen:d1"])
    group = build_topology(compile_program(fl(cfg), cfg)).groups["critic_step"]
    assert group.nodes == ["advantage", "critic_step"] and group.strategy.short() == "d2"
    cfg = load_config(REPO / "graphs/arith_ppo.yaml",
                      [*TINY, "cluster.n_gpus_per_node=4", "compile.allocation=train:t2 | critic_step:t2 + gen:d1"])
    group = build_topology(compile_program(fl(cfg), cfg)).groups["train_step"]
    assert {"train_step", "critic_step"} <= set(group.nodes) and group.strategy.short() == "d1t2"
    cfg = load_config(REPO / "graphs/arith_ppo.yaml",
                      [*TINY, "cluster.n_gpus_per_node=4", "compile.allocation=train:t2p2 | critic_step:t2p2 + gen:d1"])
    with pytest.raises(AllocationError, match="critic_step.*rule 'critic-parallel'"):
        compile_program(fl(cfg), cfg)
    cfg = load_config(REPO / "graphs/arith_ppo.yaml",
                      [*TINY, "cluster.n_gpus_per_node=4", "compile.allocation=train:d1 | critic_step:d1 + gen:d1"])
    plan = compile_program(fl(cfg), cfg)
    edited = dataclasses.replace(plan, nodes=tuple(dataclasses.replace(n, strategy="t2p2") if n.name == "critic_step"
                                                   else n for n in plan.nodes))
    with pytest.raises(ExecutableError, match="critic_step.*rule 'critic-parallel'"):
        check_runnable(edited, build_topology(plan))  # what a run checks before any process starts


def _kill_replica_when(out: Path, n_records: int, died: list) -> None:
    """Kill the process bound to the ``generate-0`` inbox once ``n_records`` samples trained."""
    import time

    import psutil

    deadline = time.monotonic() + 300
    trajectories = out / "trajectories" / "trajectories.jsonl"
    while time.monotonic() < deadline:
        if trajectories.is_file() and len(trajectories.read_text().splitlines()) >= n_records:
            for child in psutil.Process().children(recursive=True):
                try:
                    if any(str(c.laddr).endswith("generate-0") for c in child.net_connections(kind="unix")):
                        child.kill()
                        died.append(child.pid)
                        return
                except psutil.Error:
                    continue
        time.sleep(0.05)


@pytest.mark.slow
def test_killed_generation_replica_restarts_and_no_group_is_lost(tmp_path, warm_cache):
    import threading

    cfg = load_config(REPO / "graphs/arith_grpo.yaml",
                      ["train.steps=6", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10",
                       "eval.enabled=false", f"out_dir={tmp_path}", "name=killed", "scheduler.max_restarts=2",
                       "cluster.n_gpus_per_node=3", "compile.allocation=gen:d2 + train:d1"])
    from areal_flow.cli import load_flow

    died: list = []
    killer = threading.Thread(target=_kill_replica_when, args=(tmp_path / "killed", 8, died), daemon=True)
    killer.start()
    summary = run_experiment(load_flow(REPO / "graphs/arith_grpo.py")(cfg), cfg, show_progress=False)
    assert died, "the replica was not killed"
    assert summary["workers"]["router"]["replica_restarts"] == 1
    _exactly_once(tmp_path / "killed", 6, 2, 4, k=2)  # nothing lost, nothing trained twice, bound kept


def test_vllm_with_top_p_below_one_is_refused_naming_the_node():
    from types import SimpleNamespace

    from runtime.executors.generate import EngineRefused, GenerateExecutor

    node = SimpleNamespace(attrs={"engine": "vllm", "top_p": 0.9}, where=lambda: "node 'generate' (generate, g.py:7)")
    with pytest.raises(EngineRefused, match=r"node 'generate' \(generate, g.py:7\): engine='vllm' with top_p=0.9"):
        GenerateExecutor(node, ctx=None)


OWN_REWARD_GRAPH = '''
from areal_flow import Model, flow, ops


def own_reward(output_text, answer):  # defined here: worker processes cannot import this file
    return 1.0 if output_text.strip() == answer else 0.0


@flow
def own_reward_grpo(cfg):
    policy = Model("policy", cfg.model)
    rollout = ops.generate(policy, ops.dataset(cfg.dataset), n_samples=cfg.gen.n_samples,
                           max_new_tokens=cfg.gen.max_new_tokens)
    adv = ops.advantage(rollout, ops.reward(rollout, fn=own_reward), estimator="grpo")
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats
'''


@pytest.mark.slow
def test_a_reward_function_defined_in_the_graph_file_runs_locally(tmp_path, warm_cache):
    graph = tmp_path / "own.py"
    graph.write_text(OWN_REWARD_GRAPH)
    done = subprocess.run([sys.executable, "-m", "areal_flow.cli", "run", str(graph), "--config",
                           str(REPO / "graphs/arith_grpo.yaml"), *TINY, f"out_dir={tmp_path}", "name=own"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    records = _exactly_once(tmp_path / "own", 3, 2, 4, k=2)
    assert all(r["reward"] == (1.0 if r["output_text"].strip() == r["meta"]["answer"] else 0.0) for r in records)


def test_a_failing_reward_is_marked_with_its_kind_and_counted():
    """Failed samples score a 0.0 placeholder and are marked; the runtime drops them from their
    group before any statistic (tests/test_reliability.py)."""
    from areal_flow.ops.reward import score
    from areal_flow.rewards.pool import FailureMonitor, RewardPool
    from areal_flow.types import Trajectory

    def flaky(text, answer):
        if text == "boom":
            raise RuntimeError("reward service down")
        return float("nan") if text == "nan" else 1.0

    group = [Trajectory(f"0:{j}", 0, [1], [2], [-0.1], [0], "stop", output_text=text, meta={"answer": "1"})
             for j, text in enumerate(("ok", "boom", "nan"))]
    monitor = FailureMonitor("reward node 'reward'", max_fraction=1.0, window=10)
    assert score(group, RewardPool(flaky, workers=2, timeout_s=5.0), monitor) == [1.0, 0.0, 0.0]
    assert [t.meta.get("reward_failed", False) for t in group] == [False, "RuntimeError", "non-finite"]
    assert monitor.kinds == {"RuntimeError": 1, "non-finite": 1} and monitor.samples == 3


@pytest.mark.slow
def test_observability_of_a_run(penalty_run):
    """eval.every, learning rate, weight-sync time and bytes, reward failures, memory profile."""
    out, cfg = penalty_run
    assert len(_scalars(out, "eval/accuracy")) == 2  # after steps 1 and 2 (step 3 is the final evaluation)
    assert _scalars(out, "train/lr") == pytest.approx([cfg.train.lr] * 3)
    assert len(_scalars(out, "weights/bytes")) == 2  # no publication after the last step
    assert all(b > 0 for b in _scalars(out, "weights/bytes")) and all(s >= 0 for s in _scalars(out, "weights/sync_s"))
    assert _scalars(out, "reward/failures") == [0.0] * 3
    memory = [json.loads(line) for line in (out / "memory.jsonl").read_text().splitlines()]
    assert [m["step"] for m in memory] == [0, 1, 2] and all(m["rss_bytes"] > m["train_step/tensor_bytes"] > 0
                                                            for m in memory)


def test_colocated_generation_and_training_take_turns_on_one_mesh():
    from areal_flow.cli import load_flow
    from compiler.program import compile_program
    from runtime.launch import _time_shared

    def topology(*overrides):
        cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*TINY, *overrides])
        return build_topology(compile_program(load_flow(REPO / "graphs/arith_grpo.py")(cfg), cfg))

    shared = topology("cluster.n_gpus_per_node=1", "compile.allocation=gen:d1 | train:d1")
    assert _time_shared(shared) == [shared.generation.mesh]  # one lock: engine steps and train steps alternate
    assert _time_shared(topology("compile.allocation=gen:d1 + train:d1")) == []
