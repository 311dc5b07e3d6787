"""Bad inputs of a run are refused before its folder is touched (issue 28, items 4 and 5): a
dataset value from an override or a YAML file, a graph's dataset of the wrong task for its
warm start, a missing data file, and a hand-edited plan.json (an unknown ``run`` key, a node
attribute of the wrong type or value). Each gives one ``areal-flow: error:`` line naming the
culprit, exit 2, and the earlier run's folder stays where it was with what it held. The CLI
runs in-process (``main``); the overrides keep a run that is *not* refused short (what the
code before these checks did: it ran, or it failed mid-run after moving the folder aside).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from areal_flow.cli import main

REPO = Path(__file__).resolve().parents[1]
GRAPH = REPO / "graphs/arith_grpo.py"
SHORT = ("train.steps=1", "train.batch_size=1", "gen.n_samples=2", "warm_start.steps=1", "eval.enabled=false",
         "logging.trace=false")


def cli(*argv: str) -> tuple[int, str]:
    """``areal-flow ARGV`` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(a) for a in argv])
    return code, err.getvalue()


def refused(code: int, err: str, *culprits: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("areal-flow: error: "), err
    for culprit in culprits:
        assert culprit in lines[0], (culprit, lines[0])


@pytest.fixture
def earlier(tmp_path) -> Path:
    """An earlier run's folder ``<tmp>/exp``: a refused run must leave it alone."""
    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "events.out.tfevents.1").write_text("earlier run")
    return folder


def untouched(earlier: Path) -> None:
    """No folder moved aside (``exp.old-*``) and the earlier run's files as they were."""
    assert [p.name for p in earlier.parent.iterdir() if p.is_dir()] == ["exp"]
    assert [p.name for p in earlier.iterdir()] == ["events.out.tfevents.1"]
    assert (earlier / "events.out.tfevents.1").read_text() == "earlier run"


@pytest.mark.parametrize("override, culprits", [
    ("dataset.max_digits=0", ["dataset.max_digits=0", "int >= 1"]),
    ("dataset.prompt_style=chatty", ["dataset.prompt_style='chatty'", "'plain' or 'chat'"]),
    ("dataset.ops=*", ["dataset.ops=*", "command line", "not a YAML value"]),
    ('dataset.ops="*"', ["dataset.ops='*'", "'+', '-' or '+-'"]),
    ("dataset.name=gsm8k", ["model 'policy'", "warm_start.teacher_bug_rate=0.7", "gsm8k task"]),
    ("dataset.path=/nonexistent/x.jsonl", ["dataset.path='/nonexistent/x.jsonl'", "arithmetic task reads no data file"]),
    ("dataset.name=gsm8", ["dataset.name='gsm8'", "did you mean 'gsm8k'?"]),
])
def test_a_bad_dataset_value_is_refused_before_the_run_folder_is_touched(override, culprits, earlier):
    code, err = cli("run", GRAPH, f"out_dir={earlier.parent}", "name=exp", *SHORT, override)
    refused(code, err, *culprits)
    untouched(earlier)


def test_a_missing_data_file_names_the_dataset_node_before_the_run_folder_is_touched(earlier):
    graph = REPO / "graphs/gsm8k_grpo.py"
    code, err = cli("run", graph, f"out_dir={earlier.parent}", "name=exp", *SHORT, "dataset.path=/nonexistent/x.jsonl")
    refused(code, err, "node 'dataset' (dataset, ", "gsm8k_grpo.py:", "dataset.path='/nonexistent/x.jsonl'", "no such GSM8K file")
    untouched(earlier)



def test_a_local_vllm_run_without_vllm_is_refused_before_the_run_folder_is_touched(earlier, monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find(name, *a))
    code, err = cli("run", GRAPH, f"out_dir={earlier.parent}", "name=exp", *SHORT, "gen.engine=vllm")
    refused(code, err, "node 'generate' (generate, ", "arith_grpo.py:", "engine='vllm' (gen.engine)",
            "vllm is not installed", "gen.engine=embedded")
    untouched(earlier)

@pytest.fixture(scope="module")
def plan_data(tmp_path_factory) -> dict:
    """A short arith_grpo plan whose run folder is ``<tmp>/exp`` (the tests point out_dir at theirs)."""
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    code, err = cli("compile", GRAPH, "name=exp", *SHORT, "--plan", "-o", out)
    assert code == 0, err
    return json.loads(out.read_text())


def _node(plan: dict, op: str) -> dict:
    return next(n for n in plan["nodes"] if n["op"] == op)


EDITS = {  # a hand edit -> what the one line names
    "run.stepz": (lambda p: p["run"].update(stepz=3), ["plan.run: unknown key 'stepz'; did you mean 'steps'?"]),
    "run.warm_start.stepz": (lambda p: p["run"]["warm_start"].update(stepz=3),
                             ["plan.run.warm_start: unknown key 'stepz'; did you mean 'steps'?"]),
    "run.eval.n_test": (lambda p: p["run"]["eval"].update(n_test="5"),
                        ["plan.run.eval.n_test='5' is not int (config key eval.n_test)"]),
    "train_step.lr": (lambda p: _node(p, "train_step")["attrs"].update(lr="fast"),
                      ["plan node 'train_step': lr='fast' is not float (config key train.lr)"]),
    "train_step.lrr": (lambda p: _node(p, "train_step")["attrs"].update(lrr=1e-3),
                       ["plan node 'train_step': unknown attribute 'lrr'; did you mean 'lr'?"]),
    "generate.n_samples": (lambda p: _node(p, "generate")["attrs"].update(n_samples="2"),
                           ["plan node 'generate': n_samples='2' is not int (an argument of ops.generate)"]),
    "train_step.max_nonfinite_steps": (lambda p: _node(p, "train_step")["attrs"].update(max_nonfinite_steps=0),
                                       ["plan node 'train_step': train.max_nonfinite_steps=0: must be an integer >= 1"]),
    "dataset.max_digits": (lambda p: _node(p, "dataset")["attrs"].update(max_digits=0),
                           ["plan node 'dataset': dataset.max_digits=0: the arithmetic task takes an int >= 1"]),
    # found by the new-user trial: this plan ran and never finished a group (hung)
    "generate.n_samples<1": (lambda p: _node(p, "generate")["attrs"].update(n_samples=-4),
                             ["plan node 'generate': ", "n_samples=-4: must be >= 1"]),
    "run.scheduler.type": (lambda p: p["run"]["scheduler"].update(type="slurm"),
                           ["plan.run: scheduler.type='slurm': expected 'local' or 'ray'"]),
    # what the runtime cannot run: the compiler's one predicate (compiler.executable), before any process
    "generate.strategy": (lambda p: _node(p, "generate").update(strategy="d1t2"),
                          ["node 'generate' strategy d1t2: rule 'engine-parallel'"]),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_hand_edited_plan_is_refused_naming_file_node_and_field(edit, plan_data, earlier):
    change, culprits = EDITS[edit]
    plan = json.loads(json.dumps(plan_data))
    plan["run"]["out_dir"] = str(earlier.parent)
    change(plan)
    path = earlier.parent / "edited.json"
    path.write_text(json.dumps(plan))
    code, err = cli("run", "--plan", path)
    refused(code, err, f"{path}: ", *culprits)
    untouched(earlier)


def test_every_attribute_lower_attrs_writes_is_in_the_table_the_plan_is_checked_against():
    """``program.LOWERED`` names, per op, the config key of each attribute ``lower_attrs``
    writes; a graph of each node kind (GRPO, PPO's critic and GAE, a multi-turn rollout)."""
    import argparse

    from areal_flow.cli import flow_config, load_flow
    from compiler.lowering import DERIVED, LOWERED
    from compiler.program import lower_attrs

    seen = set()
    for name in ("arith_grpo", "arith_ppo", "agent_support"):
        flow = load_flow(REPO / f"graphs/{name}.py")
        cfg = flow_config(flow, argparse.Namespace(config=None, overrides=[]))
        graph = flow(cfg)
        before = {n.name: dict(n.attrs) for n in graph.nodes.values()}
        lower_attrs(graph, cfg)
        for node in graph.nodes.values():
            written = {k for k, v in node.attrs.items() if before[node.name].get(k, object()) != v}
            assert written <= set(LOWERED.get(node.op, {})) | set(DERIVED.get(node.op, ())), (name, node.name, written)
            seen |= {(node.op, k) for k in written}
    assert ("train_step", "lr") in seen and ("generate", "max_batch_size") in seen and ("rollout", "engine_dtype") in seen


def test_config_from_values_runs_the_checks_a_loaded_config_runs():
    from areal_flow.config import ConfigError
    from areal_flow.config_load import config_from_values, key_type

    cfg = config_from_values({"train.lr": 0.5, "async.max_staleness": 3, "dataset.max_digits": 2})
    assert (cfg.train.lr, cfg.async_.max_staleness, cfg.dataset.max_digits, cfg.seed) == (0.5, 3, 2, 1)
    assert key_type("train.lr") is float and key_type("async.max_staleness") is int and key_type("train.nope") is None
    with pytest.raises(ConfigError, match=r"^async.max_staleness=-1: must be >= 0$"):
        config_from_values({"async.max_staleness": -1})
    with pytest.raises(ConfigError, match=r"^dataset.ops='x': "):
        config_from_values({"dataset.ops": "x"})
