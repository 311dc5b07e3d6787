"""Fault drills (``debug.kill_at``, ``runtime/faults.py``): the entries' check, the point that
fires once per run, and on the local scheduler a generation replica and the trainer killed
mid-weight-update (the same kills on Ray: ``test_ray_faults``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_resume import STEPS, _cli, _event_steps, _exactly_once, _finish, _same, _weights

REPO = Path(__file__).resolve().parents[1]


def test_kill_at_entries_are_checked_and_fire_once_per_run(tmp_path):
    from areal_flow.config import ConfigError, parse_kill_at

    assert parse_kill_at("train_step/0:weights_published:4") == ("train_step/0", "weights_published", 4)
    for entry in ("generate/0:weights_loaded:2", "generate:weights_received:2", "generate/0:weights_received:0",
                  "generate/0:weights_received"):
        with pytest.raises(ConfigError, match=f"debug.kill_at entry '{entry}': expected"):
            parse_kill_at(entry)
    # the point fires in a child process (it SIGKILLs itself); with the marker written, not again
    plan = ("from types import SimpleNamespace as S; "
            "p = S(run={'debug': {'kill_at': ['generate/0:weights_received:2']}})")
    child = [sys.executable, "-c", f"{plan}; from runtime.faults import kill_point; "
             f"kill_point(p, {str(tmp_path)!r}, 'generate/0', 'weights_received', 1); "
             f"kill_point(p, {str(tmp_path)!r}, 'generate/1', 'weights_received', 2); print('passed'); "
             f"kill_point(p, {str(tmp_path)!r}, 'generate/0', 'weights_received', 2); print('not reached')"]
    done = subprocess.run(child, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == -9 and done.stdout == "passed\n", done.stderr
    assert "generate/0: debug.kill_at generate/0:weights_received:2: killing this process" in done.stderr
    assert (tmp_path / "faults/generate-0-weights_received-2").read_text() == "generate/0:weights_received:2"
    done = subprocess.run(child, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "passed\nnot reached\n", done.stderr


@pytest.mark.slow
def test_local_kills_mid_weight_update_keep_the_run_bit_for_bit(tmp_path, uninterrupted, warm_cache):
    """As on Ray: the replica killed holding version 2 not yet loaded, the trainer killed after sending version 4
    and before recording step 3 (the last checkpoint, version_2, is then behind what the replica was sent)."""
    err = _finish(_cli(tmp_path, "mid", "async.max_staleness=0", "scheduler.max_restarts=2",
                       "debug.kill_at=[generate/0:weights_received:2, train_step/0:weights_published:4]"))
    assert "areal-flow: generate/0 died (exit code -9); restarting it at policy version 1 (1/2)" in err
    assert ("areal-flow: train_step/0 died (exit code -9); restarting every worker from version_2 at step 2 "
            "(2/2 restarts)") in err
    assert _same(_weights(tmp_path / "mid/model"), _weights(uninterrupted / "model"))
    _exactly_once(tmp_path / "mid", k=0)
    assert _event_steps(tmp_path / "mid") == list(range(STEPS))
    restarts = json.loads((tmp_path / "mid/summary.json").read_text())["restarts"]
    assert restarts["replica_restarts"] == 1 and restarts["trainer_restarts"] == 1
    assert restarts["causes"] == ["generate/0 died (exit code -9)", "train_step/0 died (exit code -9)"]


def test_kill_at_entries_that_could_never_fire_are_refused_before_any_worker_starts(tmp_path):
    """Issue 13: arith_grpo has the workers generate/0 (the replica) and train_step/0 (the trainer) and,
    at train.steps=3, publishes versions 1..3; any other target is one line, exit 2, and no run folder."""
    from areal_flow.config import ConfigError
    from runtime.faults import check_kill_at
    from runtime.topology import build_topology
    from test_resume import _plan
    from test_resume_arguments import _run_cli

    plan = _plan(tmp_path, "debug.kill_at=[generate/0:weights_received:3, train_step/0:weights_published:1]")
    check_kill_at(plan, build_topology(plan))  # both exist: no error
    cases = {"trainer/0:weights_published:2": "this plan has no worker trainer/0; its workers: generate/0, "
                                              "train_step/0",
             "generate/5:weights_received:2": "this plan has no worker generate/5",
             "train_step/0:weights_published:99": "version 99 is beyond train.steps=3 (the run publishes "
                                                  "versions 1..3)",
             "train_step/0:weights_received:2": "worker train_step/0 never passes weights_received; workers of "
                                                "generate do"}
    for entry, message in cases.items():
        plan = _plan(tmp_path, f"debug.kill_at=[{entry}]")
        with pytest.raises(ConfigError, match=re.escape(f"debug.kill_at entry '{entry}': {message}")):
            check_kill_at(plan, build_topology(plan))
    done = _run_cli(tmp_path, f"out_dir={tmp_path}", "name=never",
                    "debug.kill_at=[generate/0:weights_received:2, generate/5:weights_received:2]")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert done.stderr.startswith("areal-flow: error: debug.kill_at entry 'generate/5:weights_received:2': this "
                                  "plan has no worker generate/5"), done.stderr
    assert not (tmp_path / "never").exists()  # nothing written


def test_a_list_key_given_one_value_says_it_takes_a_list():
    from areal_flow.config import ConfigError
    from areal_flow.config_load import load_config

    for key in ("debug.kill_at", "debug.record"):
        with pytest.raises(ConfigError, match=re.escape(f"config key '{key}' (command line) takes a list, even of "
                                                        f"one entry: {key}=[...]")):
            load_config(REPO / "graphs/arith_grpo.yaml", [f"{key}=train_step/0:weights_published:3"])


def test_a_restarted_auto_engine_announces_again_and_gets_every_version_in_its_dtype(tmp_path):
    """``gen.dtype=auto`` (the plan's ``weights_dtype: engine``): the replica killed with version 2 unread restarts,
    announces its dtype as a fresh subscriber, and the resync and every later version reach it; each version in the
    dtype its live engine announced (a dtype changed under a live subscriber would have been refused by its tensor-set
    check). The restarted engine times bf16 against fp32 afresh, so it may choose the other dtype: from the first
    version after the restart on (version 3: the replica died receiving version 2; k = 0 holds version 3 until it is
    back and has announced)."""
    err = _finish(_cli(tmp_path, "auto", "gen.dtype=auto", "async.max_staleness=0", "scheduler.max_restarts=1",
                       "debug.kill_at=[generate/0:weights_received:2]"))
    assert "areal-flow: generate/0 died (exit code -9); restarting it at policy version 1 (1/1)" in err
    steps = [json.loads(line) for line in (tmp_path / "auto/steps.jsonl").read_text().splitlines()]
    sent = [s["weights/bytes"] for s in steps if "weights/bytes" in s]
    assert len(sent) == STEPS - 1 and len(set(sent[:2])) == 1 and len(set(sent[2:])) == 1, sent
    summary = json.loads((tmp_path / "auto/summary.json").read_text())
    assert summary["restarts"]["replica_restarts"] == 1 and summary["workers"]["generate/0"]["weight_updates"] >= 1
    assert "announced" not in err  # no announcement came after a version in another dtype
