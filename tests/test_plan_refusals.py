"""A saved plan that cannot run is refused before any process starts, naming the culprit: a hand
edit of ``plan.json`` (a node, edge, route, k, B, loss or run field lost or out of range) fails
``compiler.plan.Plan.from_dict`` with the words below; an unknown op fails the topology; a torn
plan file fails ``areal-flow run --plan`` with its file and line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from areal_flow.config_load import load_config
from compiler.plan import Plan
from runtime.topology import TopologyError, build_topology

REPO = Path(__file__).resolve().parents[1]
TINY = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false"]


def _compiled() -> dict:
    from areal_flow.cli import load_flow
    from compiler.program import compile_program

    cfg = load_config(REPO / "graphs/arith_grpo.yaml", TINY)
    return json.loads(compile_program(load_flow(REPO / "graphs/arith_grpo.py")(cfg), cfg).to_json())


def _drop_node(data: dict, name: str) -> None:
    data["nodes"] = [n for n in data["nodes"] if n["name"] != name]


def _drop_edge(data: dict, src: str, dst: str) -> None:
    data["edges"] = [e for e in data["edges"] if (e["src"], e["dst"]) != (src, dst)]


def _node(data: dict, name: str) -> dict:
    return next(n for n in data["nodes"] if n["name"] == name)


def _train_edge(data: dict) -> dict:
    return next(e for e in data["edges"] if e["dst"] == "train_step")


BROKEN = {  # hand edit -> the error's words
    "node removed": (lambda d: _drop_node(d, "reward"), "comes from 'reward', which is not a node"),
    "edge removed": (lambda d: _drop_edge(d, "generate", "reward"), "generate.rollouts -> reward.rollouts has no edge"),
    "route node removed": (lambda d: _drop_node(d, "sync_weights"), "'sync_weights' is not a node"),
    "negative k": (lambda d: _train_edge(d).update(max_staleness=-1),
                   "plan edge advantage -> train_step: max_staleness must be an int >= 0, got -1"),
    "k not an int": (lambda d: _train_edge(d).update(max_staleness=1.5), "max_staleness=1.5 is not int | None"),
    "B zero": (lambda d: _train_edge(d).update(batch_groups=0),
               "plan edge advantage -> train_step: batch_groups=0 must be an int >= 1"),
    "negative micro-batches": (lambda d: _node(d, "train_step").update(micro_batches=-3),
                               "plan node 'train_step': micro_batches=-3 must be an int >= 1 (micro-batches per DP "
                               "rank) or null"),
    "zero micro-batches": (lambda d: _node(d, "train_step").update(micro_batches=0),
                           "plan node 'train_step': micro_batches=0 must be an int >= 1"),
    "k lost": (lambda d: _train_edge(d).update(max_staleness=None),
               "plan edge advantage -> train_step: no max_staleness (k, the staleness bound)"),
    "B lost": (lambda d: _train_edge(d).update(batch_groups=None),
               "plan edge advantage -> train_step: no batch_groups (B, prompt groups per step)"),
    "route to the reward": (lambda d: d["routes"][0].update(dst="reward"),
                            "plan route train_step -> reward: 'reward' is a reward; weights go to a generator"),
    "route removed, k small": (lambda d: (d.update(routes=[]), _train_edge(d).update(max_staleness=1)),
                               "no route sends 'train_step''s weights to 'generate', which then samples from version "
                               "0 only: admission stops after k + 1 = 2 of 3 steps; add the route back, or set k >= 2"),
    "loss lost": (lambda d: _node(d, "train_step")["attrs"].pop("loss"),
                  "plan node 'train_step': attrs.loss must be the LossConfig mapping, got None"),
    "loss partial": (lambda d: _node(d, "train_step")["attrs"]["loss"].pop("clip_eps_high"),
                     "plan node 'train_step': attrs.loss lacks clip_eps_high"),
    "loss out of range": (lambda d: _node(d, "train_step")["attrs"]["loss"].update(clip_eps_high=1.5),
                          "plan node 'train_step': attrs.loss: LossConfig.clip_eps_high=1.5: must be in [0, 1)"),
    "loss of another algorithm": (lambda d: _node(d, "train_step")["attrs"]["loss"].update(policy_loss="sapo"),
                                  "plan node 'train_step': attrs.loss: algorithm 'grpo' uses policy_loss='ppo', "
                                  "not 'sapo'"),
    "unknown algorithm": (lambda d: _node(d, "train_step")["attrs"].update(algorithm="my_grpo"),
                          "plan node 'train_step': algorithm 'my_grpo' is neither built in nor carried in "
                          "plan.algorithms"),
    "unknown estimator": (lambda d: _node(d, "advantage")["attrs"].update(estimator="my_adv"),
                          "plan node 'advantage': estimator 'my_adv' is neither built in nor carried in "
                          "plan.estimators"),
    "run lost": (lambda d: d.update(run={"name": "x"}), "plan.run lacks out_dir, seed, steps"),
    "steps not a number": (lambda d: d["run"].update(steps="three"), "plan.run.steps='three': must be an int >= 1"),
    "negative top-level k": (lambda d: d.update(max_staleness=-1), "plan: max_staleness must be an int >= 0, got -1"),
    "meshes overlapping": (lambda d: _node(d, "train_step")["mesh"].update(first_device=0, n_devices=2),
                           "plan nodes 'generate' (mesh n0:g0) and 'train_step' (mesh n0:g0-1) overlap"),
    "a mesh shared by hand": (lambda d: _node(d, "train_step")["mesh"].update(first_device=0),
                              "plan nodes 'generate' and 'train_step' share mesh n0:g0, but the plan is not colocated "
                              "(allocation 'gen:d1 + train:d1')"),
    "mesh lost": (lambda d: _node(d, "generate").pop("mesh"), "plan node 'generate' is missing field 'mesh'"),
    "weights in no dtype": (lambda d: _node(d, "sync_weights")["attrs"].update(weights_dtype="int8"),
                            "plan node 'sync_weights': weights_dtype='int8' is not a dtype (one of float32"),
}


@pytest.mark.parametrize("edit", list(BROKEN))
def test_a_broken_plan_is_refused_naming_the_culprit(edit):
    from compiler.plan import PlanSchemaError

    data = _compiled()
    change, words = BROKEN[edit]
    change(data)
    with pytest.raises(PlanSchemaError, match=re.escape(words)):
        Plan.from_dict(data)


def test_an_unknown_op_is_refused_before_any_process():
    data = _compiled()
    _node(data, "reward")["op"] = "rewrad"
    with pytest.raises(TopologyError, match=r"node 'reward' \(rewrad, .*\): unknown op 'rewrad'; did you mean 'reward'"):
        build_topology(Plan.from_dict(data))


def test_run_plan_refuses_config_and_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 2,')
    done = subprocess.run([sys.executable, "-m", "areal_flow.cli", "run", "--plan", str(bad)], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and f"{bad} line 1" in done.stderr
    done = subprocess.run([sys.executable, "-m", "areal_flow.cli", "run", "--plan", str(bad), "--config", "x.yaml"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "takes no graph file, --config" in done.stderr
