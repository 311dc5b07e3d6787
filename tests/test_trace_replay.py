"""Seeing and replaying a run (``runtime.trace``, ``runtime.timeline``, ``runtime.record``,
``runtime.replay``) and the staleness contract at k = 0.

* the merged trace holds one pid per worker/edge, one tid per track, spans in time order;
* a tiny run's trace shows one prompt group's path in order: engine step, reward, the
  channel, advantage, train_step (forward, backward, optimizer inside it), weight publish,
  receive and load on the replica;
* ``replay`` of a recorded ``advantage->train_step`` gives bit-identical weights per step,
  also across a trainer restart; a record missing steps is named;
* a k = 0 run in asynchronous mode trains the synchronous baseline's weights bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_flow import Model, flow, ops
from areal_flow.cli import main
from areal_flow.config_load import load_config
from areal_flow.ops import register_op
from areal_flow.cli.run import run_experiment
from runtime.record import RecordError
from runtime.replay import replay
from runtime.timeline import summarize, token_staleness
from runtime.trace import TraceRecorder, merge_trace

REPO = Path(__file__).resolve().parents[1]
TINY = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false"]


@register_op("trace_length_penalty", inputs={"rollouts": "rollouts", "rewards": "rewards"},
             outputs={"rewards": "rewards"})
def trace_length_penalty(rollouts, rewards, coef=0.0):
    """``r - coef * response tokens``: rewards that differ within a group even for a policy that
    never answers right (10 warm-start steps), so every step has a gradient."""
    return [r - coef * len(t.output_ids) for t, r in zip(rollouts, rewards)]


@flow
def penalized_grpo(cfg):
    policy = Model("policy", cfg.model)
    rollout = ops.generate(policy, ops.dataset(cfg.dataset), n_samples=cfg.gen.n_samples,
                           max_new_tokens=cfg.gen.max_new_tokens)
    rewards = trace_length_penalty(rollout, ops.reward(rollout, fn="arithmetic"), coef=0.25, name="penalty")
    adv = ops.advantage(rollout, rewards, estimator="grpo")
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats


def test_merged_trace_has_a_pid_per_proc_a_tid_per_track_and_spans_in_time_order(tmp_path):
    a, b = TraceRecorder(tmp_path, "generate/0"), TraceRecorder(tmp_path, "driver")
    a.complete("generate", "engine", 30, 45, step=1)
    a.complete("reward->advantage", "lane 0", 10, 50, cat="edge", proc="edge reward->advantage", wait="channel")
    b.complete("dataset->generate", "admission", 20, 25, cat="edge", wait="admission")
    a.close(), b.close()
    TraceRecorder(None, "off").complete("x", "y", 0, 1)  # disabled: writes nothing
    events = json.loads(merge_trace(tmp_path).read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "driver", 2: "generate/0", 3: "edge reward->advantage"}  # driver, workers, edges
    spans = [e for e in events if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"], e["pid"]) for e in spans] == [
        ("reward->advantage", 10, 40, 3), ("dataset->generate", 20, 5, 1), ("generate", 30, 15, 2)]
    assert len({e["tid"] for e in spans}) == 3 and spans[2]["args"] == {"step": 1}


def test_token_staleness_counts_policy_tokens_only(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"step": 3, "versions": [1, 2, 2], "loss_mask": None},  # staleness 2, 1, 1
            {"step": 3, "versions": [3, -1, -1, 2], "loss_mask": [1, 0, 0, 1]}]  # 0 and 1; env tokens left out
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert token_staleness(path) == {0: 1, 1: 3, 2: 1}


def _run(tmp_path: Path, name: str, *overrides: str) -> Path:
    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*TINY, f"out_dir={tmp_path}", f"name={name}", *overrides])
    run_experiment(penalized_grpo(cfg), cfg, show_progress=False)
    return tmp_path / name


def _spans(run: Path) -> list[dict]:
    events = json.loads((run / "trace.json").read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    return [{**e, "proc": procs[e["pid"]]} for e in events if e["ph"] == "X"]


def _one(spans: list[dict], name: str, proc: str, **args) -> dict:
    found = [s for s in spans if s["name"] == name and s["proc"] == proc
             and all(s["args"].get(k) == v for k, v in args.items())]
    assert len(found) == 1, (name, proc, args, found)
    return found[0]


@pytest.mark.slow
def test_trace_shows_a_groups_path_in_order_and_replay_is_bit_identical(tmp_path, warm_cache):
    run = _run(tmp_path, "rec", "debug.record=[advantage->train_step]")
    spans = _spans(run)
    end = lambda s: s["ts"] + s["dur"]  # noqa: E731
    engine = next(s for s in spans if s["name"] == "generate" and 0 in s["args"]["finished"])
    assert engine["proc"] == "generate/0"
    reward = _one(spans, "reward", "generate/0", index=0)
    penalty = _one(spans, "penalty", "generate/0", index=0)
    channel = _one(spans, "penalty->advantage", "edge penalty->advantage", index=0, wait="channel")
    batch_wait = _one(spans, "penalty->advantage", "train_step/0", step=0, wait="batch")
    advantage = _one(spans, "advantage", "train_step/0", step=0)
    train = _one([s for s in spans if s["cat"] == "node"], "train_step", "train_step/0", step=0)  # not its phases
    publish = _one(spans, "sync_weights", "train_step/0", phase="publish", version=1)
    # the generator loads the newest version at an engine-step boundary: when versions 1 and 2
    # are both out by then (a loaded machine), version 1 is never received; take its first one
    received = min(s["args"]["version"] for s in spans if s["name"] == "sync_weights"
                   and s["proc"] == "generate/0" and s["args"].get("phase") == "receive")
    receive = _one(spans, "sync_weights", "generate/0", phase="receive", version=received)
    load = _one(spans, "sync_weights", "generate/0", phase="load", version=received)
    phases = [s for s in spans if s["name"] == "train_step" and s["cat"] == "phase" and s["args"]["step"] == 0]
    # k = 2: the decoupled loss takes the proximal log-probs from the step's own forward (one update a
    # step: the weights before it), so no extra no-grad forward; 2 groups x 4 = 8 rows fit one
    # micro-batch: one forward, one backward
    assert [(s["args"]["phase"], s["args"].get("micro_batch")) for s in phases] == [
        ("forward", 0), ("backward", 0), ("optimizer", None)]
    assert {s["proc"] for s in phases} == {"train_step/0"}
    assert train["ts"] <= phases[0]["ts"] and end(phases[-1]) <= end(train)
    path = [engine, reward, penalty, channel, advantage, *phases, publish]
    assert all(end(a) <= b["ts"] for a, b in zip(path, path[1:]))
    assert end(batch_wait) <= advantage["ts"] and end(channel) <= end(batch_wait)
    published = _one(spans, "sync_weights", "train_step/0", phase="publish", version=received)
    assert publish["ts"] <= published["ts"] <= end(receive) <= load["ts"]
    timeline = summarize(run)
    assert set(timeline.nodes) == {"generate", "reward", "penalty", "advantage", "train_step", "sync_weights"}
    assert timeline.waits[("penalty->advantage", "channel")].count == 6  # 3 steps x 2 groups
    assert {key: p.count for key, p in timeline.phases.items()} == {
        ("train_step", "forward"): 3, ("train_step", "backward"): 3, ("train_step", "optimizer"): 3}  # 3 steps, 1 micro-batch
    assert sum(timeline.staleness["advantage->train_step"].values()) > 0

    digests = [json.loads(x)["digest"] for x in (run / "record/advantage-train_step/digests.jsonl").read_text()
               .splitlines()]
    assert len(set(digests)) == 3  # the weights change every step, so equal digests below mean something
    report = replay(run, "advantage->train_step")
    assert [(c.step, c.node) for c in report.checks] == [(0, "train_step"), (1, "train_step"), (2, "train_step")]
    assert [c.replayed for c in report.checks] == digests and report.identical
    assert main(["replay", str(run), "--from", "advantage->train_step", "--until", "1"]) == 0  # the command: exit 0


@pytest.mark.slow
def test_a_record_across_a_trainer_restart_replays_bit_identical_over_every_step(tmp_path, warm_cache):
    """Issue 13: the trainer killed after publishing version 3 restarts from version_2; the record
    keeps steps 0 and 1 of the first attempt, so replay from the initial weights reproduces all 4;
    likewise after a resume for 2 more steps (the parity graph of test_resume, through the CLI)."""
    from test_resume import _cli, _finish

    record = "debug.record=[advantage->train_step]"
    _finish(_cli(tmp_path, "recr", "train.steps=4", "scheduler.max_restarts=1", record, "logging.trace=false",
                 "debug.kill_at=[train_step/0:weights_published:3]"))
    run = tmp_path / "recr"
    assert json.loads((run / "summary.json").read_text())["restarts"]["trainer_restarts"] == 1
    folder = run / "record/advantage-train_step"
    assert sorted(p.name for p in folder.glob("step_*.pt")) == [f"step_{s}.pt" for s in range(4)]
    digests = [json.loads(x) for x in (folder / "digests.jsonl").read_text().splitlines()]
    assert [d["step"] for d in digests] == [0, 1, 2, 3]  # the killed attempt's later lines were rewound away
    assert len({d["digest"] for d in digests}) == 4  # the weights change every step: equal digests mean something
    report = replay(run, "advantage->train_step")
    assert [c.step for c in report.checks] == [0, 1, 2, 3]
    assert [c.replayed for c in report.checks] == [d["digest"] for d in digests] and report.identical
    assert main(["replay", str(run), "--from", "advantage->train_step"]) == 0
    _finish(_cli(tmp_path, "recr", "train.steps=6", record, "logging.trace=false", "--resume", str(run)))
    report = replay(run, "advantage->train_step")
    assert [c.step for c in report.checks] == [0, 1, 2, 3, 4, 5] and report.identical
    assert [c.recorded for c in report.checks[:4]] == [d["digest"] for d in digests]  # kept as they were


def test_replay_of_a_record_missing_steps_names_them(tmp_path, capsys):
    """A record lacking steps (e.g. debug.record first set on a resume) cannot replay from the
    initial weights: one line naming the steps, exit 2, instead of a DIFFERS per step."""
    record = tmp_path / "record/advantage-train_step"
    record.mkdir(parents=True)
    (record / "meta.json").write_text("{}")
    for step in (2, 3):
        (record / f"step_{step}.pt").write_bytes(b"x")
    (tmp_path / "plan.json").write_text("{}")
    with pytest.raises(RecordError, match=r"the record lacks step\(s\) 0, 1 of 0..3; replay starts from the initial"):
        replay(tmp_path, "advantage->train_step")
    assert main(["replay", str(tmp_path), "--from", "advantage->train_step"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lacks step(s) 0, 1 of 0..3" in err, err


@pytest.mark.slow
@pytest.mark.ci
def test_k0_async_trains_the_synchronous_baselines_weights_bit_for_bit(tmp_path, warm_cache):
    record = "debug.record=[advantage->train_step]"
    sync = _run(tmp_path, "sync", "async.max_staleness=0", "compile.mode=sync", record, "logging.trace=false")
    asyn = _run(tmp_path, "async", "async.max_staleness=0", "compile.mode=async", record, "logging.trace=false")
    assert json.loads((sync / "plan.json").read_text())["mode"] == "sync"
    assert json.loads((asyn / "plan.json").read_text())["mode"] == "async"
    assert not (asyn / "trace.json").exists()  # logging.trace=false
    digests = [(run / "record/advantage-train_step/digests.jsonl").read_text() for run in (sync, asyn)]
    assert len(digests[0].splitlines()) == 3 and digests[0] == digests[1]
    assert (sync / "model/model.safetensors").read_bytes() == (asyn / "model/model.safetensors").read_bytes()


def test_record_edges_are_checked_before_any_worker_starts():
    from compiler.program import compile_program
    from areal_flow.config_compile import CompileConfigError
    from runtime.record import RecordError, check_edges

    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*TINY, "debug.record=[advantage->train]"])
    with pytest.raises(CompileConfigError, match="'advantage->train' is not a data edge.*advantage->train_step"):
        compile_program(penalized_grpo(cfg), cfg)
    cfg = load_config(REPO / "graphs/arith_grpo.yaml", TINY)
    plan = compile_program(penalized_grpo(cfg), cfg)
    batch = ["advantage", "train_step"]
    assert check_edges(plan, ["advantage->train_step", "penalty->advantage"], batch) == [
        ("advantage", "train_step", "advantages"), ("penalty", "advantage", "rewards")]
    with pytest.raises(RecordError, match="'generate->reward' is not an edge into a batch node"):
        check_edges(plan, ["generate->reward"], batch)  # reward runs per group on the replica
