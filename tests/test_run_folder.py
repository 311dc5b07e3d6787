"""The run folder explains itself and old ones do not pile up (issue 28, item 10): the resolved
config (``config.yaml``) and every start's command line (``commands.jsonl``) are kept in it,
and of the folders earlier runs of the name were moved aside to only the newest
``keep_old_runs`` stay (``runtime.run_dir``)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ["train.steps=1", "train.batch_size=1", "gen.n_samples=2", "warm_start.steps=1", "eval.enabled=false"]


def test_prune_keeps_the_newest_moved_aside_folders_of_the_name_and_nothing_else(tmp_path):
    from runtime.run_dir import prune_old_runs

    names = ["exp.old-20250101-000000", "exp.old-20250101-000000-2", "exp.old-20250101-000000-10",
             "exp.old-20241231-235959", "exp.old-20250102-000000"]
    for name in names:
        (tmp_path / name).mkdir()
    others = ["exp", "exp2.old-20200101-000000", "exp.old-x", "exp.old-20200101-000000.bak", "notes"]
    for name in others:
        (tmp_path / name).mkdir()
    (tmp_path / "exp.old-20200101-000000-3").write_text("a file, not a run folder")
    # by stamp, then counter: 20241231-235959 < 20250101-000000 < ...-2 < ...-10 < 20250102-000000
    deleted = prune_old_runs(tmp_path / "exp", keep=2)
    assert [p.name for p in deleted] == ["exp.old-20241231-235959", "exp.old-20250101-000000",
                                         "exp.old-20250101-000000-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        others + ["exp.old-20200101-000000-3", "exp.old-20250101-000000-10", "exp.old-20250102-000000"])
    assert prune_old_runs(tmp_path / "exp", keep=2) == []
    assert [p.name for p in prune_old_runs(tmp_path / "exp", keep=0)] == ["exp.old-20250101-000000-10",
                                                                         "exp.old-20250102-000000"]


def test_a_new_run_records_its_config_and_command_and_bounds_the_old_folders(tmp_path, monkeypatch, capsys):
    from areal_flow.cli import load_flow
    from areal_flow.config_load import config_yaml, load_config
    from compiler.program import compile_program
    from runtime.launch import RunSetup

    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*TINY, f"out_dir={tmp_path / 'runs'}", "name=exp",
                                                         "keep_old_runs=2"])
    plan = compile_program(load_flow(REPO / "graphs/arith_grpo.py")(cfg), cfg)
    text = config_yaml(cfg)
    monkeypatch.chdir(tmp_path)  # no git repository here
    for n in range(4):
        out = RunSetup.create(plan, show_progress=False, config_yaml=text).out_dir
        (out / "events.out.tfevents.1").write_text(f"run {n}")
        time.sleep(1.05 if n < 3 else 0)  # moved-aside names carry the second
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(runs) == 3 and runs[0] == "exp" and all(r.startswith("exp.old-") for r in runs[1:])
    kept = [(tmp_path / "runs" / r / "events.out.tfevents.1").read_text() for r in runs]
    assert kept == ["run 3", "run 1", "run 2"]  # run 0 was deleted when run 3 started
    assert "deleted 1 older run folder(s) beyond keep_old_runs=2: exp.old-" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["commands.jsonl", "config.yaml", "events.out.tfevents.1",
                                                     "plan.json"]
    assert load_config(out / "config.yaml") == cfg  # the resolved config, read back whole
    (line,) = (out / "commands.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["argv"] == sys.orig_argv and record["cwd"] == str(tmp_path)
    assert (record["git_commit"], record["git_dirty"]) == (None, None)
    assert abs(time.mktime(time.strptime(record["time"], "%Y-%m-%dT%H:%M:%S%z")) - time.time()) < 60


def test_the_command_names_the_git_commit_of_the_working_folder(tmp_path, monkeypatch):
    from runtime.run_dir import record_start

    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("1")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(tmp_path)
    record_start(run, None)
    (tmp_path / "a.txt").write_text("2")  # a tracked file changed
    record_start(run, None)  # a resume: a second line
    lines = [json.loads(line) for line in (run / "commands.jsonl").read_text().splitlines()]
    assert [(r["git_commit"], r["git_dirty"]) for r in lines] == [(head, False), (head, True)]
    assert not (run / "config.yaml").exists()  # `run --plan`: the plan is the program


def test_keep_old_runs_is_a_config_key_of_the_plan_and_may_not_be_negative():
    from areal_flow.config import ConfigError
    from areal_flow.config_load import load_config

    assert load_config(None, []).keep_old_runs == 3
    with pytest.raises(ConfigError, match=r"^keep_old_runs=-1: must be >= 0 \(command line\)$"):
        load_config(None, ["keep_old_runs=-1"])


def test_run_writes_the_resolved_config_and_run_plan_does_not(tmp_path, monkeypatch):
    """Through the CLI: ``run graph.py`` keeps the config it resolved, ``run --plan`` only its
    command (the plan is the program); stopped (Ctrl-C) once the folder is started."""
    import contextlib
    import io

    from areal_flow.cli import main
    from areal_flow.config_load import load_config
    from runtime.run_setup import RunSetup

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(RunSetup, "prepare", interrupted)
    overrides = [*TINY, f"out_dir={tmp_path}", "name=exp", "train.lr=5e-4"]
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert main(["run", str(REPO / "graphs/arith_grpo.py"), *overrides]) == 130
    run = tmp_path / "exp"
    assert load_config(run / "config.yaml") == load_config(REPO / "graphs/arith_grpo.yaml", overrides)
    assert load_config(run / "config.yaml").train.lr == 5e-4
    (plan := tmp_path / "plan.json").write_text((run / "plan.json").read_text())
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert main(["run", "--plan", str(plan)]) == 130
    assert sorted(p.name for p in run.iterdir()) == ["commands.jsonl", "plan.json"]
    assert json.loads((run / "commands.jsonl").read_text())["argv"] == sys.orig_argv


def test_a_rewound_folder_keeps_the_step_metrics_before_the_checkpoint_and_drops_a_torn_line(tmp_path):
    """Issue 26: the trainer's steps.jsonl is rewound like its trajectories; a last line a kill
    tore mid-write (no newline) is of a step after the checkpoint and is dropped."""
    from runtime.run_dir import STEPS_FILE, rewind_run_dir

    traj = tmp_path / "trajectories"
    traj.mkdir()
    (traj / "trajectories.jsonl").write_text('{"step": 0, "staleness": 0}\n{"step": 2, "staleness": 1}\n{"st')
    (tmp_path / STEPS_FILE).write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(3)))
    assert rewind_run_dir(tmp_path, 2) == (1, {0: 1})  # step 0's one sample, staleness 0
    assert [json.loads(x)["step"] for x in (tmp_path / STEPS_FILE).read_text().splitlines()] == [0, 1]
    assert (traj / "trajectories.jsonl").read_text() == '{"step": 0, "staleness": 0}\n'


def _as_written_earlier(folder: Path, suffix: str, seconds: int) -> None:
    """Rename ``folder``'s one event file ending in ``suffix`` as a file written ``seconds`` ago.
    TensorBoard reads a folder's files in name order, and two writers of one process in one
    second differ only by a counter (".9" sorts after ".10" once earlier tests made writers)."""
    (written,) = [f for f in folder.glob("events.out.tfevents.*") if f.name.endswith(suffix) and "earlier" not in f.name]
    written.rename(folder / f"events.out.tfevents.{int(time.time()) - seconds}.earlier{suffix}")


def test_a_resumed_logger_logs_the_steps_no_event_file_holds(tmp_path):
    """Issue 26: a driver SIGKILLed before its TensorBoard writer flushed step 1 (or before the
    trainer's report of it arrived): the resumed run's logger logs step 1 from steps.jsonl,
    once, and neither step 0 again (its events are there) nor step 2 (after the checkpoint)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from runtime.metrics import RunLogger
    from runtime.run_dir import STEPS_FILE

    with SummaryWriter(log_dir=str(tmp_path)) as earlier:  # the killed driver's events: step 0 only
        earlier.add_scalar("rl/reward", 0.5, 0)
    _as_written_earlier(tmp_path, "", 60)
    steps = [{"step": s, "reward": 0.5 + s / 4, "train/loss": 1.0 - s / 4, "staleness": [0, 1]} for s in range(3)]
    (tmp_path / STEPS_FILE).write_text("".join(json.dumps(m) + "\n" for m in steps))
    RunLogger(tmp_path, total_steps=4, show_progress=False, first_step=2).close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("rl/reward")] == [(0, 0.5), (1, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(0, 1.0), (1, 0.75)]


def test_a_second_resume_reads_the_purged_events_without_printing_tensorboards_purge_warning(tmp_path, caplog):
    """Attempt A logged steps 0-3 and died after checkpoint 2; attempt B resumed at 2
    (``purge_step=2``), flushed step 2 and died after checkpoint 4 with step 3 recorded only in
    steps.jsonl. Attempt C's logger must see A's steps 2-3 as purged (as TensorBoard shows it) and
    so log step 3 from steps.jsonl, without the reader's "out of order ... Purging" warning."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from runtime.metrics import RunLogger
    from runtime.run_dir import STEPS_FILE

    with SummaryWriter(log_dir=str(tmp_path), filename_suffix=".a") as a:
        for step in range(4):
            a.add_scalar("rl/reward", 0.0, step)
    _as_written_earlier(tmp_path, ".a", 120)
    with SummaryWriter(log_dir=str(tmp_path), purge_step=2, filename_suffix=".b") as b:
        b.add_scalar("rl/reward", 1.0, 2)
    _as_written_earlier(tmp_path, ".b", 60)
    (tmp_path / STEPS_FILE).write_text("".join(json.dumps({"step": s, "reward": 1.0}) + "\n" for s in range(4)))
    with caplog.at_level(logging.WARNING):
        RunLogger(tmp_path, total_steps=6, show_progress=False, first_step=4).close()
    assert not [r for r in caplog.records if "out of order" in r.getMessage()]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("rl/reward")] == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0)]
    with caplog.at_level(logging.WARNING):  # the filter was this read's only: TensorBoard's own reads still warn
        EventAccumulator(str(tmp_path)).Reload()
    assert any(r.getMessage().startswith("Detected out of order event.step") for r in caplog.records)
