"""What a resume accepts and refuses (issues 13 and 26): the run folder kept and its program
compared with the new plan, ``--resume`` arguments checked in one line, ``--resume RUN_FOLDER``
alone running the folder's own plan, a complete run's resume running nothing. The end-to-end
resumes and restarts: test_resume; the checkpoint files: test_checkpoint_files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.checkpoint import ResumeError, write_checkpoint
from test_resume import TINY, _models, _plan

REPO = Path(__file__).resolve().parents[1]


def test_a_resume_keeps_the_folder_and_refuses_another_program(tmp_path, capsys):
    from runtime.run_setup import RunSetup

    run_dir = RunSetup.create(_plan(tmp_path), show_progress=False).out_dir
    write_checkpoint(run_dir / "checkpoints", 2, _models, {"version": 2}, next_index=4)
    (run_dir / "events.out.tfevents.1").write_text("kept")
    setup = RunSetup.create(_plan(tmp_path, "scheduler.max_restarts=0"), show_progress=False, resume="auto")
    assert setup.checkpoint.version == 2 and (run_dir / "events.out.tfevents.1").read_text() == "kept"
    assert f"resuming {run_dir} from version_2 (step 2 of 3)" in capsys.readouterr().err
    # issue 13: the dotted key and both values (the plan's lr is train.lr, 1e-4 by default)
    with pytest.raises(ResumeError, match=r"another program than this run's \(they differ in "
                                          r"nodes.train_step.attrs.lr: 0.0001 in the run, 0.0005 now\);"):
        RunSetup.create(_plan(tmp_path, "train.lr=5e-4"), show_progress=False, resume=str(run_dir))
    wide = _plan(tmp_path, "cluster.n_gpus_per_node=3", "compile.allocation=train:d2 + gen:d1",
                 "train.checkpoint_every=1")
    (run_dir / "plan.json").write_text(wide.to_json())
    assert RunSetup.create(wide, show_progress=False, resume=str(run_dir)).checkpoint.version == 2  # issue 13: DCP
    capsys.readouterr()
    one_rank = _plan(tmp_path, "cluster.n_gpus_per_node=2", "compile.allocation=train:d1 + gen:d1",
                     "train.checkpoint_every=1")  # another allocation of the train_step (and cluster size): reshards
    assert RunSetup.create(one_rank, show_progress=False, resume=str(run_dir)).checkpoint.version == 2
    assert ("areal-flow: train_step 'train_step' reshards its checkpoint from world size 2 (strategy d2) to world "
            "size 1 (strategy d1)") in capsys.readouterr().err
    assert json.loads((run_dir / "plan.json").read_text())["allocation"] == "train:d1 + gen:d1"  # the plan it runs
    # gen:d1 -> gen:d2: the generate node's strategy, and 2 x 4 samples decoded at once over 2 replicas, 4 each
    with pytest.raises(ResumeError, match=r"another program than this run's \(they differ in "
                                          r"nodes.generate.concurrent: 8 in the run, 4 now; nodes.generate.strategy: "
                                          r"\"d1\" in the run, \"d2\" now; routes: .*; compile.allocation may "
                                          r"change the train_steps' strategies only\)"):
        RunSetup.create(_plan(tmp_path, "cluster.n_gpus_per_node=4", "compile.allocation=train:d2 + gen:d2",
                              "train.checkpoint_every=1"), show_progress=False, resume=str(run_dir))  # generation too


def test_a_resume_may_continue_for_more_steps_and_names_train_steps(tmp_path, capsys):
    from runtime.run_setup import RunSetup

    run_dir = RunSetup.create(_plan(tmp_path), show_progress=False).out_dir  # train.steps=3
    write_checkpoint(run_dir / "checkpoints", 2, _models, {"version": 2}, next_index=4)
    with pytest.raises(ResumeError, match=r"differ in train.steps: 3 in the run, 1 now; train.steps=1 is below the "
                                          r"checkpoint's step 2"):
        RunSetup.create(_plan(tmp_path, "train.steps=1"), show_progress=False, resume="auto")
    setup = RunSetup.create(_plan(tmp_path, "train.steps=5"), show_progress=False, resume="auto")
    assert setup.checkpoint.version == 2 and setup.topo.steps == 5
    assert json.loads((run_dir / "plan.json").read_text())["run"]["steps"] == 5  # the plan the folder now runs
    assert "resume=auto without train.checkpoint_every" in capsys.readouterr().err


def test_a_run_folder_moved_aside_or_copied_resumes_where_it_is(tmp_path, capsys):
    """Issue 13: the folder given to --resume is the run (the CLI sets name/out_dir from it), so
    a folder the tool moved aside (``exp.old-<stamp>``) or a copy resumes in place."""
    import shutil

    from runtime.run_setup import RunSetup

    run_dir = RunSetup.create(_plan(tmp_path), show_progress=False).out_dir
    write_checkpoint(run_dir / "checkpoints", 2, _models, {"version": 2}, next_index=4)
    moved = run_dir.rename(tmp_path / "exp.old-20260101-000000")
    copy = Path(shutil.copytree(moved, tmp_path / "elsewhere" / "copy"))
    for folder in (moved, copy):
        plan = _plan(tmp_path, f"out_dir={folder.parent}", f"name={folder.name}")
        setup = RunSetup.create(plan, show_progress=False, resume=str(folder))
        assert setup.out_dir == folder and setup.checkpoint.folder == folder / "checkpoints/version_2"
        assert json.loads((folder / "plan.json").read_text())["run"]["name"] == folder.name  # the plan it runs
        assert f"resuming {folder} from version_2" in capsys.readouterr().err
    assert not run_dir.exists()  # nothing written under the old name


def test_resume_alone_of_a_folder_moved_aside_or_copied_runs_its_plan_where_it_is(tmp_path, monkeypatch):
    """``--resume FOLDER`` alone runs FOLDER/plan.json, whose name/out_dir still name the old place:
    the run's folder is FOLDER (docs/RESUME.md), found by the new-user trial of 2026-12-05."""
    import argparse

    import runtime.launch
    from areal_flow.cli.run import run_command

    ran = []
    monkeypatch.setattr(runtime.launch, "run", lambda plan, resume: ran.append((plan.run, resume)))
    plan = _plan(tmp_path)  # writes to tmp_path/exp
    for folder in (tmp_path / "exp.old-20261205-000000", tmp_path / "elsewhere" / "copy"):
        folder.mkdir(parents=True)
        (folder / "plan.json").write_text(plan.to_json())
        args = argparse.Namespace(plan=None, file=None, resume=str(folder), overrides=[], config=None, flow=None)
        assert run_command(args) == 0
        run, resume = ran.pop()
        assert (run["name"], run["out_dir"], resume) == (folder.name, str(folder.parent), str(folder))
        assert {k: v for k, v in run.items() if k not in ("name", "out_dir")} == \
            {k: v for k, v in plan.run.items() if k not in ("name", "out_dir")}  # nothing else changed


def test_a_resume_with_the_graph_file_keeps_the_runs_allocation_on_the_same_cluster(tmp_path, monkeypatch):
    """New-user trial: a run placed by ``compile.allocation`` and resumed with its graph file but
    without that override was placed anew by the search (and resharded); verl/AReaL keep it."""
    import argparse

    import areal_flow.cli.run as cli_run

    seen = []
    monkeypatch.setattr(cli_run, "run_flow", lambda flow, cfg, config: seen.append(cfg.compile.allocation) or 0)
    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "plan.json").write_text(_plan(tmp_path, "cluster.n_gpus_per_node=3",
                                            "compile.allocation=train:d2 + gen:d1").to_json())

    def resume(*overrides):
        args = argparse.Namespace(plan=None, file=str(REPO / "graphs/arith_grpo.py"), resume=str(folder),
                                  overrides=[*TINY, *overrides], config=None, flow=None)
        assert cli_run.run_command(args) == 0
        return seen.pop()

    assert resume("cluster.n_gpus_per_node=3") == "train:d2 + gen:d1"  # the run's, not the search's
    assert resume("cluster.n_gpus_per_node=2") is None  # another cluster: the search places it (reshards)
    assert resume("cluster.n_gpus_per_node=3", "compile.allocation=train:d1 + gen:d2") == "train:d1 + gen:d2"


def test_an_override_in_the_graph_files_place_is_named_as_one(tmp_path):
    """``areal-flow run --resume R train.steps=10``: argparse takes the override for the graph file."""
    import argparse

    from areal_flow.cli.common import CLIError
    from areal_flow.cli.run import run_command

    args = argparse.Namespace(plan=None, file="train.steps=10", resume="auto", overrides=[], config=None, flow=None)
    with pytest.raises(CLIError, match=r"^train.steps=10 is an override \(KEY=VALUE\), not a graph file"):
        run_command(args)


def _run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_flow.cli", "run", "graphs/arith_grpo.py", *TINY, *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_resume_arguments_are_checked_in_one_line(tmp_path):
    from runtime.run_setup import RunSetup

    run_dir = RunSetup.create(_plan(tmp_path), show_progress=False).out_dir  # tmp_path/exp
    write_checkpoint(run_dir / "checkpoints", 2, _models, {"version": 2}, next_index=4)
    cases = [(("--resume", str(tmp_path / "nope")), f"--resume {tmp_path / 'nope'}: no such folder"),
             (("--resume", str(run_dir / "checkpoints/version_2")), f"a checkpoint folder; pass the run folder {run_dir}"),
             (("--resume", str(run_dir), "name=other"), "is the run folder of name=exp, but name=other was also given"),
             (("--resume", str(run_dir), "resume=auto"), f"--resume {run_dir} and resume=auto both given"),
             (("resume=yes",), "resume='True' (YAML reads yes/no/true/false as a boolean): expected '' (a new run), "
                                "'auto'"),
             (("resume=latest",), "resume='latest': expected '' (a new run), 'auto'"),
             # name and out_dir come from the folder: the plan is compared with exp's, and differs in train.lr only
             (("--resume", str(run_dir), "train.lr=5e-4"), f"cannot resume {run_dir}: its plan.json is another "
                                                            "program than this run's (they differ in "
                                                            "nodes.train_step.attrs.lr: 0.0001 in the run, 0.0005 now)")]
    for args, message in cases:
        done = _run_cli(tmp_path, *args)
        assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, (args, done.stderr[-2000:])
        assert done.stderr.startswith("areal-flow: error: ") and message in done.stderr, (args, done.stderr)


def test_resuming_a_complete_run_runs_nothing_and_writes_nothing(tmp_path, capsys):
    from runtime.launch import run
    from runtime.run_setup import RunSetup

    run_dir = RunSetup.create(_plan(tmp_path), show_progress=False).out_dir
    write_checkpoint(run_dir / "checkpoints", 3, _models, {"version": 3}, next_index=6)  # TINY: 3 steps
    (run_dir / "summary.json").write_text('{"samples_trained": 24}')
    (run_dir / "trace.json").write_text("kept")
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    assert run(_plan(tmp_path), show_progress=True, resume=str(run_dir)) == {"samples_trained": 24}
    out, err = capsys.readouterr()  # that line alone: no "resuming ... (step 3 of 3)", no plan table
    assert (out, err) == ("", f"areal-flow: {run_dir} is complete: version_3 holds all 3 steps; nothing to resume\n")
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    assert (run_dir / "trace.json").read_text() == "kept"
    # `--resume RUN_FOLDER` alone runs the folder's own plan.json (issue 26): the same line, nothing written
    done = subprocess.run([sys.executable, "-m", "areal_flow.cli", "run", "--resume", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr) == (0, f"areal-flow: {run_dir} is complete: version_3 holds all 3 steps; "
                                                 "nothing to resume\n"), done.stderr[-2000:]
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    done = subprocess.run([sys.executable, "-m", "areal_flow.cli", "run", "--resume", str(run_dir), "--config",
                           "graphs/arith_grpo.yaml"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr == (f"areal-flow: error: --resume {run_dir} without a graph file runs "
                                                    "the folder's plan.json as it is: overrides need the graph file "
                                                    "too (areal-flow run GRAPH.py KEY=VALUE --resume RUN_FOLDER)\n")


def test_the_cli_names_a_folder_that_is_not_the_runs_in_one_line(tmp_path):
    plan = tmp_path / "plan.json"
    subprocess.run([sys.executable, "-m", "areal_flow.cli", "compile", "graphs/arith_grpo.py", *TINY,
                    f"out_dir={tmp_path}", "name=exp", "--plan", "-o", str(plan)], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    (tmp_path / "other").mkdir()
    (tmp_path / "other/plan.json").write_text(plan.read_text())
    done = subprocess.run([sys.executable, "-m", "areal_flow.cli", "run", "--plan", str(plan), "--resume",
                           str(tmp_path / "other")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    assert done.stderr.startswith(f"areal-flow: error: --resume {tmp_path / 'other'}: this plan writes to "
                                  f"{tmp_path / 'exp'} (out_dir and name)") and done.stderr.count("\n") == 1
    assert not (tmp_path / "exp").exists()  # nothing started
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp/plan.json").write_text(plan.read_text())
    done = subprocess.run([sys.executable, "-m", "areal_flow.cli", "run", "--plan", str(plan), "--resume",
                           str(tmp_path / "exp")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr == (f"areal-flow: error: --resume {tmp_path / 'exp'}: no complete "
                                                    f"checkpoint under {tmp_path / 'exp/checkpoints'} (train."
                                                    "checkpoint_every > 0 writes them; resume=auto starts fresh "
                                                    "instead)\n")


def test_a_run_written_before_weights_dtype_resumes_and_another_program_still_does_not(tmp_path):
    from runtime.run_setup import RunSetup

    run_dir = RunSetup.create(_plan(tmp_path), show_progress=False).out_dir
    write_checkpoint(run_dir / "checkpoints", 2, _models, {"version": 2}, next_index=4)
    old = json.loads((run_dir / "plan.json").read_text())
    sync = next(n for n in old["nodes"] if n["op"] == "sync_weights")
    assert sync["attrs"].pop("weights_dtype") == "float32"  # as a plan of an earlier version was written
    (run_dir / "plan.json").write_text(json.dumps(old))
    assert RunSetup.create(_plan(tmp_path), show_progress=False, resume="auto").checkpoint.version == 2
    with pytest.raises(ResumeError, match=r"differ in .*lr"):
        RunSetup.create(_plan(tmp_path, "train.lr=0.5"), show_progress=False, resume="auto")
