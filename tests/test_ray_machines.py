"""Issue 24: on Ray (``scheduler.type=ray``) every plan ``compile`` emits is one the Ray
layout places: ``compiler.hosting``'s rule ``ray-one-machine`` (a worker group's actors
divide evenly over its mesh's machines; a trainer is one actor, so it lies on one machine)
is asked by the search, by a user's allocation and by ``runtime.ray_scheduler``. No Ray
cluster is started: the layout is computed from the plan alone."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from areal_flow.cli import load_flow
from areal_flow.config_load import load_config
from areal_flow.ops.registry import SOURCE, STREAM
from compiler.allocation import AllocationError
from compiler.hosting import Hosted, ray_hosting_problem
from compiler.mesh import MeshSpec
from compiler.program import compile_program
from compiler.strategy import ParallelStrategy
from runtime.topology import build_topology

REPO = Path(__file__).resolve().parents[1]
TINY = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false"]
ONE_DEVICE_MACHINES = ["cluster.n_nodes=3", "cluster.n_gpus_per_node=1"]


def _plan(tmp_path, *overrides):
    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*TINY, *ONE_DEVICE_MACHINES, f"out_dir={tmp_path}", *overrides])
    return compile_program(load_flow(REPO / "graphs/arith_grpo.py")(cfg), cfg)


def test_the_search_on_ray_keeps_the_trainer_on_one_machine_and_the_ray_layout_places_it(tmp_path):
    from runtime.ray_scheduler import RayScheduler, _settings

    # The local scheduler's best plan spans two machines with its trainer (the case Ray refused at run).
    assert _plan(tmp_path, "scheduler.type=local").node("train_step").mesh.label() == "n1-2"
    plan = _plan(tmp_path, "scheduler.type=ray")
    assert plan.node("train_step").mesh.n_nodes == 1
    layout = RayScheduler(SimpleNamespace(topo=build_topology(plan)), _settings(plan)).layout()
    assert layout["train_step/0"][0].n_nodes == 1 and layout["train_step/0"][2] == 1  # one actor, alone


def test_a_trainer_spanning_machines_is_refused_at_compile_on_ray_and_compiles_for_the_local_scheduler(tmp_path):
    allocation = "compile.allocation=gen:d1 + train:d2"  # gen on n0, train_step on n1-2
    with pytest.raises(AllocationError, match=r"node 'train_step': ray-one-machine: its mesh n1-2 spans 2 machines "
                                              r"but runs as 1 actor\(s\) on Ray"):
        _plan(tmp_path, "scheduler.type=ray", allocation)
    assert _plan(tmp_path, "scheduler.type=local", allocation).allocation == "gen:d1 + train:d2"


@pytest.mark.parametrize("strategy, mesh, refused", [
    ("d2", MeshSpec(0, 2, 0, 1), False),  # one replica per machine
    ("d1t2", MeshSpec(0, 2, 0, 1), True),  # one tensor-parallel replica over two machines
    ("d1t2", MeshSpec(0, 1, 0, 2), False),  # ... inside one machine
])
def test_generation_replicas_must_each_lie_on_one_machine(strategy, mesh, refused):
    nodes = [Hosted("dataset", SOURCE, "g"), Hosted("generate", STREAM, "g", ("dataset",), "policy",
                                                  strategy=ParallelStrategy.parse(strategy))]
    problem = ray_hosting_problem(nodes, {"generate": mesh})
    assert (problem is not None) == refused
    if refused:
        assert problem[0] == "generate" and problem[1].startswith("ray-one-machine: its mesh n0-1 spans 2 machines "
                                                                  "but runs as 1 actor(s)")


def test_with_no_one_machine_trainer_mesh_left_the_search_names_the_ray_rule(tmp_path):
    from compiler.errors import InfeasiblePlanError

    # compile.pins.train=d2 on one-device machines: every trainer mesh spans two machines.
    assert _plan(tmp_path, "scheduler.type=local", "compile.pins.train=d2").allocation == "gen:d1 + train:d2"
    with pytest.raises(InfeasiblePlanError, match=r"runs on Ray within memory \(scheduler.type=ray\): the others break "
                                                  r"a rule of compiler.hosting, e.g. node 'train_step': ray-one-machine"):
        _plan(tmp_path, "scheduler.type=ray", "compile.pins.train=d2")
