"""The runtime names no op: what a node is comes from its op's declarations (grain, role,
ports, ``multi_turn``, ``max_attempts``), carried in the plan's nodes.

* a user op registered in a graph file with role ``training`` and another input port name is
  a trainer like ``train_step``: compiled, partitioned and run through ``areal-flow run``;
* declarations that disagree are refused when the op is registered;
* no module under ``runtime/`` compares a node's op (checked on the source's syntax tree).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_flow.config_load import load_config
from areal_flow.graph import GraphError, OpSpec, PortSpec
from areal_flow.ops.registry import BATCH, CPU, GROUP, STREAM, TRAINING, OpDef, define
from runtime.topology import TopologyError, build_topology, trainer_input

REPO = Path(__file__).resolve().parents[1]
TINY = ["train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false"]

OWN_TRAINER_GRAPH = '''
from areal_flow import Model, flow, ops
from areal_flow.ops import register_op


@register_op("update_policy", inputs={"batch": "advantages"}, outputs={"stats": "stats", "weights": "weights"},
             grain="batch", role="training", executor="runtime.executors.train:TrainStepExecutor")
def update_policy(batch, algorithm="grpo"):
    """The built-in trainer under another op name, taking the step's batch on port ``batch``."""


@flow
def own_trainer(cfg):
    policy = Model("policy", cfg.model)
    rollout = ops.generate(policy, ops.dataset(cfg.dataset), n_samples=cfg.gen.n_samples,
                           max_new_tokens=cfg.gen.max_new_tokens)
    adv = ops.advantage(rollout, ops.reward(rollout, fn="arithmetic"), estimator="grpo")
    stats, _ = update_policy(adv, model=policy, max_staleness=0)
    ops.sync_weights(policy, to=rollout)
    return stats
'''


def _own_trainer_plan(tmp_path, *overrides):
    from areal_flow.cli import load_flow
    from compiler.program import compile_program

    graph = tmp_path / "own_trainer.py"
    graph.write_text(OWN_TRAINER_GRAPH)
    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*TINY, "train.steps=2", f"out_dir={tmp_path}", *overrides])
    return compile_program(load_flow(graph)(cfg), cfg)


def test_a_user_op_with_role_training_is_a_trainer_whatever_its_names(tmp_path):
    plan = _own_trainer_plan(tmp_path)
    node = plan.node("update_policy")
    assert (node.trains, node.grain, node.inputs) == (True, "batch", {"batch": ["advantage", "advantages"]})
    assert node.attrs["algorithm"] == "grpo" and node.attrs["lr"] == 1e-4  # its default; train.lr, lowered
    assert [e.batch_groups for e in plan.edges if e.dst == "update_policy"] == [2]  # B on its data edge
    topo = build_topology(plan)
    assert [(g.name, g.batch_nodes) for g in topo.groups.values()] == [
        ("generate", []), ("update_policy", ["advantage", "update_policy"])]
    assert (topo.trainer.name, topo.routes, trainer_input(node)) == ("update_policy", [("update_policy", "generate")],
                                                                    "batch")


def test_a_trainer_with_two_data_inputs_is_refused_naming_it(tmp_path):
    plan = _own_trainer_plan(tmp_path)
    nodes = tuple(dataclasses.replace(n, inputs={**n.inputs, "extra": ["reward", "rewards"]})
                  if n.name == "update_policy" else n for n in plan.nodes)
    with pytest.raises(TopologyError, match=r"node 'update_policy' \(update_policy, .*own_trainer.py:\d+\): a node "
                                            r"that trains its model takes its step's batch on one data input; it has 2 "
                                            r"\(batch, extra\)"):
        build_topology(dataclasses.replace(plan, nodes=nodes))


@pytest.mark.slow
def test_a_user_trainer_runs_through_the_cli(tmp_path, warm_cache):
    graph = tmp_path / "own_trainer.py"
    graph.write_text(OWN_TRAINER_GRAPH)
    done = subprocess.run([sys.executable, "-m", "areal_flow.cli", "run", str(graph), "--config",
                           str(REPO / "graphs/arith_grpo.yaml"), *TINY, "train.steps=2", f"out_dir={tmp_path}",
                           "name=own"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "own"
    records = [json.loads(line) for line in (out / "trajectories" / "trajectories.jsonl").read_text().splitlines()]
    # 2 steps x 2 groups x 4 samples, each trained once, in its slot; no bound on the edge: k = 0
    assert sorted(r["sample_id"] for r in records) == sorted(f"{i}:{j}" for i in range(4) for j in range(4))
    assert all(r["step"] == r["group_id"] // 2 and r["step"] - min(r["versions"]) == 0 for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"]["update_policy/0"]["steps"] == 2
    assert summary["workers"]["generate/0"]["final_version"] == 1  # step 0's weights reached the replica
    assert (out / "model" / "config.json").is_file()


def _spec(name, inputs=("rollouts",), outputs=("stats", "weights"), trains=False, needs_model=True):
    return OpSpec(name, tuple(PortSpec(p, p) for p in inputs), tuple(PortSpec(p, p) for p in outputs),
                  needs_model=needs_model, trains=trains)


@pytest.mark.parametrize(("op", "rule"), [
    (OpDef(_spec("t1"), BATCH, TRAINING), "role 'training' and spec.trains go together"),
    (OpDef(_spec("t2", trains=True), BATCH, CPU), "role 'training' and spec.trains go together"),
    (OpDef(_spec("t3", trains=True), GROUP, TRAINING), "an op that trains its model has grain 'batch' and needs a model"),
    (OpDef(_spec("t4", trains=True, needs_model=False), BATCH, TRAINING),
     "an op that trains its model has grain 'batch' and needs a model"),
    (OpDef(_spec("t5", inputs=("a", "b"), trains=True), BATCH, TRAINING),
     "an op that trains its model takes the step's batch on one data input port"),
    (OpDef(_spec("t6", outputs=("stats",), trains=True), BATCH, TRAINING),
     "an op that trains its model has outputs 'stats' and 'weights'"),
    (OpDef(_spec("t7"), GROUP, CPU, multi_turn=True), "multi_turn is for 'stream' ops"),
    (OpDef(_spec("t8"), STREAM, CPU, max_attempts=lambda node: 2), "max_attempts is for 'group' ops"),
])
def test_declarations_that_disagree_are_refused(op, rule):
    with pytest.raises(GraphError, match=rf"^op '{op.name}': {rule}$"):
        define(op)


def test_the_plan_carries_what_the_ops_declare(tmp_path):
    from areal_flow.cli import load_flow
    from compiler.program import compile_program

    cfg = load_config(REPO / "graphs/arith_dapo.yaml", [*TINY, "train.steps=2", "reward.max_attempts=5"])
    plan = compile_program(load_flow(REPO / "graphs/arith_dapo.py")(cfg), cfg)
    declared = {n.name: (n.trains, n.multi_turn, n.max_attempts) for n in plan.nodes}
    assert declared["filter"] == (False, False, 5) and declared["generate"] == (False, False, None)
    assert declared["train_step"] == (True, False, None)
    cfg = load_config(REPO / "graphs/agent_guess_number.yaml", [*TINY, "train.steps=2"])
    plan = compile_program(load_flow(REPO / "graphs/agent_support.py")(cfg), cfg)
    assert [n.name for n in plan.nodes if n.multi_turn] == [n.name for n in plan.nodes if n.op == "rollout"] != []


def _op_comparisons(source: str) -> list[int]:
    """Lines of ``source`` that compare a node's op: ``x.op == ...``, ``x.get("op") in ...``,
    ``x["op"] != ...``."""
    def is_op(expr) -> bool:
        return ((isinstance(expr, ast.Attribute) and expr.attr == "op")
                or (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "get"
                    and expr.args and isinstance(expr.args[0], ast.Constant) and expr.args[0].value == "op")
                or (isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant) and expr.slice.value == "op"))

    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Compare) and any(map(is_op, [node.left, *node.comparators]))]


def test_no_runtime_module_compares_an_op():
    assert _op_comparisons('if node.op == "train_step" or n.get("op") in OPS or d["op"] != "x": pass') == [1, 1, 1]
    found = {str(p.relative_to(REPO)): lines for p in sorted((REPO / "runtime").rglob("*.py"))
             if (lines := _op_comparisons(p.read_text()))}
    assert found == {}
