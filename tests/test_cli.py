"""The command line: one-line errors naming the culprit, and the graph listing."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_flow.cli", *args], cwd=ROOT, capture_output=True, text=True)


def test_graph_command_lists_edges_and_staleness():
    out = _cli("graph", "graphs/arith_grpo.py", "async.max_staleness=3")
    assert out.returncode == 0, out.stderr
    assert "advantage.advantages -> train_step.advantages  [data]  max_staleness=3" in out.stdout


def test_user_errors_are_one_line_without_traceback(tmp_path):
    cases = [
        (("graph", "graphs/arith_grpo.py", "train.lrr=1"), "did you mean 'train.lr'"),
        (("graph", str(tmp_path / "missing.py")), "graph file not found"),
        (("graph", "README.md"), "README.md: not a graph file"),
        (("compile", "graphs/arith_grpo.py", "--allocation", "gen:d4x2"), "bad allocation at character 7"),
        (("viz", "plan.json", "-o", "out.txt"), "pick one of these suffixes"),
    ]
    for args, message in cases:
        out = _cli(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert message in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


def test_folder_and_flowless_file_say_what_they_are(tmp_path):
    (tmp_path / "helpers.py").write_text("X = 1\n")
    (tmp_path / "mine.py").write_text("from areal_flow import flow\n\n\n@flow\ndef mine(cfg):\n    return None\n")
    (tmp_path / "empty").mkdir()
    cases = [
        (("graph", str(tmp_path)), f"{tmp_path}: a folder, not a graph file; pass one of its graph files: {tmp_path / 'mine.py'}"),
        (("graph", str(tmp_path / "empty")), f"{tmp_path / 'empty'}: a folder, not a graph file; it holds no *.py file with an @flow"),
        (("compile", str(tmp_path / "helpers.py")), f"no @flow function in {tmp_path / 'helpers.py'}"),
    ]
    for args, message in cases:
        out = _cli(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.strip() == f"areal-flow: error: {message}", (args, out.stderr)


def test_viz_polish_errors_name_the_file(tmp_path):
    bad = tmp_path / "not_a_plan.json"
    bad.write_text("nope\n")
    plan = tmp_path / "plan.json"
    assert _cli("compile", "graphs/arith_grpo.py", "--plan", "-o", str(plan)).returncode == 0
    cases = [
        (("viz", str(bad), "-o", str(tmp_path / "x.html")), f"{bad}: not a plan"),  # this file, not "plan.json"
        (("viz", str(plan), "-o", str(tmp_path / "no" / "x.html")), "output folder"),
        (("compile", "graphs/arith_grpo.py", "--plan", "-o", str(tmp_path / "no" / "p.json")), "output folder"),
    ]
    for args, message in cases:
        out = _cli(*args)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_svg_without_graphviz_dot_is_one_line(tmp_path):
    plan = tmp_path / "plan.json"
    assert _cli("compile", "graphs/arith_grpo.py", "--plan", "-o", str(plan)).returncode == 0
    env = {"PATH": str(tmp_path), "PYTHONPATH": str(ROOT)}  # a PATH without the `dot` program
    out = subprocess.run([sys.executable, "-m", "areal_flow.cli", "viz", str(plan), "-o", str(tmp_path / "p.svg")],
                         cwd=ROOT, capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "Graphviz 'dot'" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_closed_pipe_is_one_line():
    # `areal-flow config | head -1` once head has left: a pipe whose reading end is closed
    read_end, write_end = os.pipe()
    os.close(read_end)
    cli = subprocess.run([sys.executable, "-m", "areal_flow.cli", "config"], cwd=ROOT, stdout=write_end,
                         stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    assert cli.returncode == 2
    assert cli.stderr.strip() == "areal-flow: error: output pipe closed before all output was written"


def test_config_lists_keys_defaults_docs_and_aliases():
    out = _cli("config")
    assert out.returncode == 0, out.stderr
    assert "  train.lr: float = 0.001\n      AdamW learning rate." in out.stdout
    assert "  async.max_staleness: int = 2" in out.stdout  # the YAML name, not the field async_
    assert "training.seed" in out.stdout and "-> seed" in out.stdout
    resolved = _cli("config", "graphs/arith_grpo.yaml", "training.seed=7", "actor.optimizer.lr=0.5")
    assert resolved.returncode == 0, resolved.stderr
    assert "\nseed: 7\n" in resolved.stdout and "  lr: 0.5\n" in resolved.stdout


def test_help_names_every_command_and_eval_knows_the_longtail_task():
    from areal_flow.cli import build_parser
    from areal_flow.config import ExperimentConfig
    from runtime.evaluate import eval_task

    out = _cli("--help")
    assert out.returncode == 0 and "config, timeline and replay." in " ".join(out.stdout.split()), out.stdout
    args = build_parser().parse_args(["eval", "runs/longtail_grpo/model", "--task", "longtail"])
    cfg = ExperimentConfig()
    cfg.dataset.name = args.task
    task = eval_task(cfg)
    problem = task.test_set(1)[0]
    assert task.reward(problem["answer"] + "<eos>", problem["answer"]) == 1.0  # the task's own answer is right
    assert task.reward(problem["answer"] + " 0", problem["answer"]) == 0.0  # one number too many


def test_bench_memory_model_help_runs_nothing():
    out = subprocess.run([sys.executable, "bench/memory_model.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0 and "--strategy" in out.stdout and "strategy  rank" not in out.stdout, out.stdout


def test_timeline_and_replay_name_a_folder_that_is_not_a_run(tmp_path, capsys):
    from areal_flow.cli import main

    (tmp_path / "trace.json").write_text("{}")  # a trace alone does not make a run folder: plan.json does
    for argv in (["timeline", str(tmp_path)], ["replay", str(tmp_path), "--from", "advantage->train_step"]):
        assert main(argv) == 2
        assert f"{tmp_path}: not a run folder (no plan.json)" in capsys.readouterr().err


def _main(*args) -> tuple[int, str]:
    """``areal-flow ARGS`` in this process: (exit code, stderr)."""
    import contextlib
    import io

    from areal_flow.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(a) for a in args])
    return code, err.getvalue()


def test_compile_keeps_a_plan_file_that_differs_unless_forced(tmp_path):
    plan = tmp_path / "plan.json"
    assert _main("compile", ROOT / "graphs/arith_grpo.py", "--plan", "-o", plan)[0] == 0
    compiled = plan.read_text()
    assert _main("compile", ROOT / "graphs/arith_grpo.py", "--plan", "-o", plan)[0] == 0  # the same plan again
    assert plan.read_text() == compiled
    edited = compiled.replace('"n_test": 500', '"n_test": 20')
    assert edited != compiled
    plan.write_text(edited)  # the hand edit the README invites
    for output in ([], ["-o", plan]):  # the default name (in the current folder) or named explicitly
        cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            code, err = _main("compile", ROOT / "graphs/arith_grpo.py", "--plan", *output, "--viz", tmp_path / "p.html")
        finally:
            os.chdir(cwd)
        assert code == 2 and err.strip() == (f"areal-flow: error: {plan if output else 'plan.json'} exists and differs "
                                             "from this plan (an edit of it would be lost); pass --force to overwrite "
                                             "it, or -o another path"), err
        assert plan.read_text() == edited and not (tmp_path / "p.html").exists()  # nothing written
    assert _main("compile", ROOT / "graphs/arith_grpo.py", "--plan", "-o", plan, "--force")[0] == 0
    assert plan.read_text() == compiled


def test_a_graph_file_without_a_yaml_beside_it_says_the_defaults_are_used(tmp_path):
    graph = tmp_path / "mine.py"
    graph.write_text((ROOT / "graphs/arith_grpo.py").read_text())
    code, err = _main("graph", graph)
    assert code == 0
    assert err.strip() == (f"areal-flow: note: no {tmp_path / 'mine.yaml'} beside the graph file: using the built-in "
                           "defaults ('areal-flow config' lists them) and the overrides; pass --config FILE to use a "
                           "YAML config"), err
    assert _main("graph", graph, "--config", ROOT / "graphs/arith_grpo.yaml") == (0, "")
    (tmp_path / "mine.yaml").write_text("seed: 2\n")
    assert _main("graph", graph) == (0, "")


def test_eval_refuses_a_bad_count_before_any_work():
    """Found by the new-user trial: `eval ... --n 0` started a 1,500-step warm start first."""
    out = _cli("eval", "graphs/arith_grpo.py", "--n", "0")
    assert out.returncode == 2 and "--n: 0 must be >= 1" in out.stderr, out.stderr
    out = _cli("eval", "graphs/arith_grpo.py", "--samples", "-1")
    assert out.returncode == 2 and "--samples: -1 must be >= 0" in out.stderr, out.stderr


def test_a_preset_whose_weights_package_is_missing_is_one_line(tmp_path, monkeypatch, capsys):
    """The GGUF weights come from a pip package; without it a run names the package and the pip
    command in one line, exit 2, no traceback."""
    import dataclasses

    from areal_flow.cli import main
    from areal_flow.models.presets import GGUF_PRESETS as PRESETS

    monkeypatch.setenv("AREAL_FLOW_CACHE", str(tmp_path))  # nothing converted before
    missing = dataclasses.replace(PRESETS["smollm2-135m"], package="no-such-package-areal-flow")
    monkeypatch.setitem(PRESETS, "smollm2-135m", missing)
    monkeypatch.chdir(ROOT)
    assert main(["run", "graphs/arith_chat_grpo.py", "train.steps=1", f"out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "areal-flow: error: package 'no-such-package-areal-flow'" in err, err
    assert "pip install --no-deps no-such-package-areal-flow" in err and "Traceback" not in err, err
