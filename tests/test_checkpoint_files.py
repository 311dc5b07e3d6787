"""Checkpoint files and the run folder (issue 13): a checkpoint counts only once renamed
with its manifest, a failed write leaves none, where a resume starts, and the run folder
rewound to a checkpoint (trajectories, ``debug.record`` records, events, and the timeline
kept across attempts)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from runtime.checkpoint import MANIFEST, ResumeError, latest_checkpoint, read_state, resume_point, write_checkpoint
from runtime.checkpoint_integrity import torn
from runtime.run_dir import rewind_run_dir
from test_resume import _models, _plan


def test_a_checkpoint_is_complete_only_once_renamed_with_its_manifest(tmp_path):
    root = tmp_path / "checkpoints"
    final = write_checkpoint(root, 2, _models, {"version": 2}, next_index=4)
    assert final == root / "version_2" and not (root / "version_2.tmp").exists()
    assert sorted(p.name for p in final.iterdir()) == [MANIFEST, "model.safetensors", "trainer_state.pt"]
    assert read_state(final) == {"version": 2}
    assert latest_checkpoint(tmp_path).manifest()["next_index"] == 4 and latest_checkpoint(tmp_path).version == 2
    write_checkpoint(root, 4, _models, {"version": 4}, next_index=8)
    (root / "version_6.tmp").mkdir()  # a write that died before its rename
    (root / "version_6.tmp" / "model.safetensors").write_bytes(b"half")
    (root / "version_8").mkdir()  # a folder without a manifest (not written by write_checkpoint)
    assert latest_checkpoint(tmp_path).version == 4
    (root / "version_4" / "model.safetensors").write_bytes(b"x" * 9)  # truncated after the fact: 9 != 10 bytes
    assert torn(root / "version_4") == "model.safetensors is 9 bytes, the manifest says 10"
    assert latest_checkpoint(tmp_path).version == 2
    assert latest_checkpoint(tmp_path / "elsewhere") is None


def test_a_failed_write_leaves_no_complete_checkpoint(tmp_path):
    def crash(folder: Path) -> None:
        _models(folder)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tmp_path / "checkpoints", 2, crash, {"version": 2}, next_index=4)
    assert latest_checkpoint(tmp_path) is None
    write_checkpoint(tmp_path / "checkpoints", 2, _models, {"version": 2}, next_index=4)  # a retry replaces the .tmp folder
    assert latest_checkpoint(tmp_path).version == 2 and not (tmp_path / "checkpoints/version_2.tmp").exists()


def test_resume_point_by_setting(tmp_path):
    run = tmp_path / "exp"
    run.mkdir()
    assert resume_point("", run) is None
    assert resume_point("auto", run) is None  # nothing to resume: a new run
    with pytest.raises(ResumeError, match="no complete checkpoint under .*exp/checkpoints"):
        resume_point(str(run), run)
    write_checkpoint(run / "checkpoints", 3, _models, {"version": 3}, next_index=6)
    assert resume_point("auto", run).version == 3 and resume_point(str(run), run).version == 3
    with pytest.raises(ResumeError, match="this plan writes to .*exp"):
        resume_point(str(tmp_path / "other"), run)


def test_rewinding_keeps_the_steps_before_the_checkpoint(tmp_path):
    traj = tmp_path / "trajectories"
    traj.mkdir()
    lines = [{"sample_id": f"{i}:0", "step": i // 2, "staleness": i % 2} for i in range(8)]  # steps 0..3, 2 each
    (traj / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "checkpoints" / "version_4.tmp").mkdir(parents=True)
    samples, staleness = rewind_run_dir(tmp_path, 2)
    kept = [json.loads(x) for x in (traj / "trajectories.jsonl").read_text().splitlines()]
    assert [r["sample_id"] for r in kept] == ["0:0", "1:0", "2:0", "3:0"]  # steps 0 and 1
    assert samples == 4 and staleness == Counter({0: 2, 1: 2})  # staleness i % 2 of i = 0..3
    assert not (tmp_path / "checkpoints" / "version_4.tmp").exists()
    (traj / "trajectories.jsonl").write_text('{"step": 0, "staleness": 0}\nnot json\n{"step": 0, "staleness": 0}\n')
    with pytest.raises(ValueError, match=r"trajectories.jsonl:2: not a trajectory record"):
        rewind_run_dir(tmp_path, 1)  # the checkpoint's own steps damaged


def test_rewinding_drops_a_hole_a_late_writer_left_after_the_cut(tmp_path, capsys):
    """Issue 26 (bench/chaos.py, Ray, a raylet killed): the trainer of the dead attempt, on the
    crashed node, wrote on at its old offset after the driver had cut the file at the
    checkpoint, leaving NUL bytes then its step-3 lines; every resume then refused the file."""
    traj = tmp_path / "trajectories"
    traj.mkdir()
    kept = "".join(json.dumps({"sample_id": f"{i}:0", "step": i // 2, "staleness": 0}) + "\n" for i in range(4))
    late = json.dumps({"sample_id": "6:0", "step": 3, "staleness": 0}) + "\n"
    (traj / "trajectories.jsonl").write_text(kept + "\0" * 300 + "\n" + late)
    samples, _ = rewind_run_dir(tmp_path, 2)
    assert samples == 4 and (traj / "trajectories.jsonl").read_text() == kept  # steps 0 and 1, nothing after
    assert "trajectories.jsonl:5: not a trajectory record" in capsys.readouterr().err


def test_a_trainer_of_a_given_up_attempt_is_fenced_off_by_the_rewind_and_by_the_next_trainer(tmp_path):
    """Issue 26 (the late writer above): the trainer's writer fence (runtime.writer_fence) lets the
    holder write, and after the driver's rewind, or once the next attempt's trainer claims the
    folder, the earlier holder's next check stops it, naming the folder and the write."""
    from runtime.writer_fence import FENCE_FILE, Superseded, check, claim

    held = claim(tmp_path)
    check(tmp_path, held, "step 0's records")  # the holder writes
    (tmp_path / "trajectories").mkdir()
    (tmp_path / "trajectories" / "trajectories.jsonl").write_text("")
    rewind_run_dir(tmp_path, 0)
    with pytest.raises(Superseded, match=f"{tmp_path}: not writing step 3's records: this trainer's attempt was "
                                          "given up"):
        check(tmp_path, held, "step 3's records")
    first, second = claim(tmp_path), claim(tmp_path)
    assert first != second and (tmp_path / FENCE_FILE).read_text() == second
    check(tmp_path, second, "the final model")
    with pytest.raises(Superseded, match="not writing the final model"):
        check(tmp_path, first, "the final model")
    assert not list(tmp_path.glob(f"{FENCE_FILE}.*.tmp"))  # no temporary token file left


def test_rewinding_keeps_the_records_of_the_steps_before_the_checkpoint(tmp_path):
    """Issue 13: a debug.record of steps 0..3 rewound to version_2 keeps steps 0 and 1 (their
    step files and digest lines), so a replay from the initial weights still covers them."""
    record = tmp_path / "record" / "advantage-train_step"
    record.mkdir(parents=True)
    for step in range(4):
        (record / f"step_{step}.pt").write_bytes(b"x")
    (record / "meta.json").write_text("{}")
    (record / "digests.jsonl").write_text("".join(json.dumps({"step": s, "node": "train_step", "digest": f"d{s}"})
                                                  + "\n" for s in range(4)))
    rewind_run_dir(tmp_path, 2)
    assert sorted(p.name for p in record.iterdir()) == ["digests.jsonl", "meta.json", "step_0.pt", "step_1.pt"]
    assert [json.loads(x)["digest"] for x in (record / "digests.jsonl").read_text().splitlines()] == ["d0", "d1"]
    rewind_run_dir(tmp_path, 0)  # a restart before the first checkpoint: every step is trained again
    assert sorted(p.name for p in record.iterdir()) == ["digests.jsonl", "meta.json"]


def test_a_resume_keeps_the_earlier_timeline_and_leaves_the_gap_out(tmp_path):
    """Issue 17: a resumed worker appends to its span file; the timeline covers both attempts,
    its wall time is the attempts' own (the 60 s between them left out)."""
    from runtime.timeline import format_timeline, summarize
    from runtime.trace import TraceRecorder, merge_trace, now_us

    (tmp_path / "plan.json").write_text(_plan(tmp_path).to_json())
    start = now_us() - 61_000_000
    first = TraceRecorder(tmp_path, "train_step/0")  # the attempt that was interrupted: busy 1 s of 1 s
    first.complete("train_step", "step", start, start + 1_000_000, step=0)
    first.close()
    rewind_run_dir(tmp_path, 1)  # 60 s later: resumed from version_1
    again = TraceRecorder(tmp_path, "train_step/0")  # the resumed attempt: busy 1 s of 2 s
    resumed = now_us() + 1000
    again.complete("train_step", "step", resumed, resumed + 1_000_000, step=1)
    again.complete("train_step", "step", resumed + 1_900_000, resumed + 2_000_000, step=2)
    again.complete("train_step", "step", resumed + 1_000_000, resumed + 1_900_000, cat="edge", wait="batch")
    again.close()
    merge_trace(tmp_path)
    t = summarize(tmp_path)
    assert t.attempts == [0, 1]
    assert t.wall_s == pytest.approx(1.0 + 2.0, abs=1e-6)  # not 63 s: the gap is no attempt's
    assert t.nodes["train_step"].busy_us == 2_100_000 and t.nodes["train_step"].fraction == pytest.approx(2.1 / 3)
    assert format_timeline(t).startswith("timeline over 3.00 s (2 attempts, from versions 0, 1; the time between "
                                         "them left out)")
    markers = [json.loads(x) for x in (tmp_path / "trace" / "driver.jsonl").read_text().splitlines()]
    assert [(m["name"], m["cat"], m["args"]) for m in markers] == [("attempt", "run", {"from_version": 1})]


def test_a_rewind_without_a_trace_folder_writes_none(tmp_path):
    rewind_run_dir(tmp_path, 2)  # logging.trace=false: no trace/ to mark
    assert not (tmp_path / "trace").exists()
