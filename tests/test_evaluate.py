"""pass@k (Chen et al. 2021, eq. 1) against hand-computed values; the eval command's errors;
``areal-flow eval`` of a graph starts from exactly the model its run starts from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from areal_flow.config import ExperimentConfig
from areal_flow.models.tiny import build_model
from areal_flow.models.tokenizer import build_char_tokenizer
from areal_flow.tasks.arithmetic import ArithmeticTask
from runtime.evaluate import eval_task, pass_at_k

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 1 / 4),              # pass@1 = c / n
    (5, 2, 2, 1 - 3 / 10),         # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 1 - 21 / 252),      # 1 - C(7,5)/C(10,5) = 1 - 21/252 = 11/12
    (10, 0, 3, 0.0),               # nothing correct
    (5, 4, 2, 1.0),                # n - c = 1 < k: every pair holds a correct sample
    (8, 8, 8, 1.0),
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_bad_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def _cfg(**dataset) -> ExperimentConfig:
    cfg = ExperimentConfig()
    cfg.seed = 1
    for key, value in dataset.items():
        setattr(cfg.dataset, key, value)
    return cfg


def test_eval_tasks_are_the_runs_dataset_tasks():
    plain = eval_task(_cfg(name="arithmetic", max_digits=2))
    chat = eval_task(_cfg(name="arithmetic", max_digits=2, prompt_style="chat"))
    a, b = plain.test_set(3), chat.test_set(3)
    assert [p["answer"] for p in a] == [p["answer"] for p in b]  # the same problems, asked two ways
    assert a[0]["prompt"].endswith("=") and b[0]["prompt"].startswith("What is")
    assert a == ArithmeticTask(seed=1, max_digits=2).test_set(3)  # a run's held-out set (seed 1, 2 digits)
    with pytest.raises(ValueError, match="task 'arith': the task names are dataset.name's: arithmetic, gsm8k, "
                                         "longtail or reasoning_gym:<dataset>; arith is 'arithmetic'"):
        eval_task(_cfg(name="arith"))
    with pytest.raises(ValueError, match="task 'guess_number' is an env task"):
        eval_task(_cfg(name="guess_number"))


def test_a_held_out_set_never_reaches_past_what_training_excludes(tmp_path):
    """The generated tasks keep test_set(500) out of training; asking for more would score trained-on
    problems, so every door refuses it: the config key, the task, and `areal-flow eval --n`."""
    from areal_flow.config import ConfigError
    from areal_flow.config_load import load_config
    from areal_flow.tasks.support_desk import SupportDeskTask
    from areal_flow.tasks.tool_multiply import ToolMultiplyTask
    from runtime.evaluate import evaluate_model

    with pytest.raises(ConfigError, match=r"eval.n_test=501: the arithmetic task keeps only its first 500"):
        load_config(ROOT / "graphs" / "arith_grpo.yaml", ["eval.n_test=501"])
    assert load_config(ROOT / "graphs" / "arith_grpo.yaml", ["eval.n_test=500"]).eval.n_test == 500
    assert load_config(ROOT / "graphs" / "gsm8k_grpo.yaml", ["eval.n_test=800"]).eval.n_test == 800  # its own split
    for task in (ArithmeticTask(seed=1, max_digits=2), SupportDeskTask(seed=1), ToolMultiplyTask(seed=1)):
        assert len(task.test_set(500)) == 500
        with pytest.raises(ValueError, match=f"test_set n=501: the {task.name} task"):
            task.test_set(501)
    with pytest.raises(ValueError, match=r"--n \(or eval.n_test\)=600"):  # before any model is read
        evaluate_model(tmp_path / "no-model", ArithmeticTask(seed=1, max_digits=2), model="tiny-arith", n=600)
    held_out = {p["prompt"] for p in ArithmeticTask(seed=1, max_digits=2).test_set(500)}
    trained = {p["prompt"] for p in ArithmeticTask(seed=1, max_digits=2).train_problems(2000, seed=2)}
    assert not held_out & trained
    wider = ArithmeticTask(seed=1, max_digits=2).train_problems(50, seed=2, exclude_test=800)  # excluding more is fine
    assert len(wider) == 50 and not {p["prompt"] for p in wider} & held_out


def test_eval_bad_model_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "areal_flow.cli", "eval", str(tmp_path / "nothing.gguf"),
                          "--task", "arithmetic", "--n", "2"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "nothing.gguf" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def _record_warm_starts(monkeypatch) -> tuple[list, list]:
    """Warm starts and evaluations asked for, instead of done: ``(warm starts, evaluations)``."""
    import runtime.evaluate as evaluate
    import runtime.engines.sft as sft

    starts, evals = [], []

    def warm_start(task, preset, cfg, cache_dir=None, progress=False):
        starts.append((task.spec(), preset, cfg))
        return Path("/nowhere/warm")

    monkeypatch.setattr(sft, "warm_start", warm_start)
    monkeypatch.setattr(evaluate, "evaluate_model", lambda folder, task, **kw: evals.append((folder, task, kw)) or {})
    return starts, evals


def test_eval_of_a_graph_starts_from_the_model_its_run_starts_from(monkeypatch, capsys):
    """``areal-flow eval graphs/arith_grpo.py`` warm-starts tiny-arith as that run does (its YAML's
    warm_start, seed and dataset: the same cache key) and scores the run's held-out problems;
    ``tiny-arith --config <its yaml>`` is the same model."""
    from areal_flow.cli import main
    from areal_flow.cli.common import flow_config, load_flow
    from compiler.program import compile_program
    from runtime.engines.sft import SFTConfig
    from runtime.model_source import prepare_models

    monkeypatch.chdir(ROOT)
    starts, evals = _record_warm_starts(monkeypatch)
    assert main(["eval", "graphs/arith_grpo.py", "--n", "3"]) == 0
    assert main(["eval", "tiny-arith", "--config", "graphs/arith_grpo.yaml", "--n", "3"]) == 0
    # graphs/arith_grpo.yaml, read by hand: seed 1, 2-digit +/- problems, 1500 steps of 128, lr 1e-3, 70 % buggy
    expected = ({"name": "arithmetic", "seed": 1, "max_digits": 2, "ops": "+-"}, "tiny-arith",
                SFTConfig(steps=1500, batch_size=128, lr=1e-3, seed=1, teacher_bug_rate=0.7))
    assert starts == [expected, expected]
    # the run's own preparation of its models asks for that warm start too
    flow = load_flow("graphs/arith_grpo.py")
    cfg = flow_config(flow, type("Args", (), {"config": None, "overrides": []}))
    plan = compile_program(flow(cfg), cfg)
    prepare_models(plan, ArithmeticTask(seed=1, max_digits=2))
    assert starts[2] == expected
    for folder, task, kw in evals:
        assert folder == Path("/nowhere/warm") and kw["n"] == 3 and kw["dtype"] == "float32"
        assert task.test_set(3) == ArithmeticTask(seed=1, max_digits=2).test_set(3)
    assert "note: no --config" not in capsys.readouterr().err


def test_eval_of_a_run_folders_model_reads_the_runs_config(monkeypatch, capsys, tmp_path):
    """``areal-flow eval runs/<name>/model`` scores under ``runs/<name>/config.yaml`` (the run's task:
    2-digit problems here, not the defaults' 3) and says so; another folder without --config gets the
    defaults and a note naming what they set."""
    from areal_flow.cli import main

    monkeypatch.chdir(ROOT)
    _, evals = _record_warm_starts(monkeypatch)
    run = tmp_path / "runs" / "mine"
    tokenizer = build_char_tokenizer()
    for folder in (run / "model", tmp_path / "loose"):  # two transformers folders, one in a run
        build_model("tiny-s", len(tokenizer)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    (run / "config.yaml").write_text("seed: 1\ndataset:\n  name: arithmetic\n  max_digits: 2\neval:\n  n_test: 4\n")
    (run / "plan.json").write_text("{}")  # what makes the folder a run's
    assert main(["eval", str(run / "model")]) == 0
    err = capsys.readouterr().err
    assert f"is scored under its run's config, {run / 'config.yaml'}" in err
    folder, task, kw = evals[-1]
    assert folder == run / "model" and kw["n"] == 4
    assert task.test_set(4) == ArithmeticTask(seed=1, max_digits=2).test_set(4)
    assert main(["eval", str(tmp_path / "loose"), "--n", "2"]) == 0
    assert "note: no --config: the defaults set the task (dataset.*) and the decoding (gen.*)" in capsys.readouterr().err
    (run / "config.yaml").write_text("seed: 1\ntrain:\n  stepz: 3\n")  # an older run's key, or a typo
    assert main(["eval", str(run / "model")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "stepz" in err and "(--config FILE scores under another config)" in err


def test_eval_help_says_which_model_it_evaluates():
    out = subprocess.run([sys.executable, "-m", "areal_flow.cli", "eval", "--help"], cwd=ROOT, capture_output=True,
                         text=True)
    text = " ".join(out.stdout.split())
    assert out.returncode == 0
    assert "Given a graph file, it evaluates exactly the model a run of that graph starts from" in text
    assert "(a tiny preset: the same warm start, from the same cache)" in text
    assert "Task names are dataset.name's (arithmetic, gsm8k, longtail)" in text
