"""Issue 24: on Ray (``scheduler.type=ray``) every plan ``compile`` emits is one the Ray
layout places: ``compiler.hosting``'s rule ``ray-one-machine`` (a worker group's actors
divide evenly over its mesh's machines: a generation replica or a judge is one actor on one
machine; the policy's multi-rank train_step runs one actor per machine, each with that
machine's ranks) is asked by the search, by a user's allocation and by
``runtime.ray_scheduler``. No Ray cluster is started: the layout is computed from the plan
alone (the run itself: ``tests/test_ray_trainer_machines.py``)."""

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


def _plan(tmp_path, *overrides, graph="arith_grpo"):
    cfg = load_config(REPO / f"graphs/{graph}.yaml", [*TINY, *ONE_DEVICE_MACHINES, f"out_dir={tmp_path}", *overrides])
    return compile_program(load_flow(REPO / f"graphs/{graph}.py")(cfg), cfg)


def _layout(plan):
    from runtime.ray_scheduler import RayScheduler, _settings

    return RayScheduler(SimpleNamespace(topo=build_topology(plan)), _settings(plan)).layout()


def test_a_trainer_spanning_machines_runs_one_actor_per_machine_on_ray(tmp_path):
    # The search picks the same plan for Ray as for the local scheduler: the trainer on n1-2.
    local, on_ray = _plan(tmp_path, "scheduler.type=local"), _plan(tmp_path, "scheduler.type=ray")
    assert local.allocation == on_ray.allocation == "gen:d1 + train:d2"
    assert on_ray.node("train_step").mesh.label() == "n1-2"
    layout = _layout(on_ray)
    mesh = on_ray.node("train_step").mesh
    # (mesh, bundle = the mesh's machine, actors sharing that bundle): rank 0's actor on n1, ranks 1.. on n2
    assert {name: where for name, where in layout.items() if name.startswith("train_step")} == {
        "train_step/0": (mesh, 0, 1), "train_step/0@n1": (mesh, 1, 1)}
    assert _plan(tmp_path, "scheduler.type=ray", "compile.pins.train=d2").allocation == "gen:d1 + train:d2"


def test_a_time_shared_mesh_spanning_machines_puts_one_replica_and_one_rank_host_per_machine(tmp_path):
    plan = _plan(tmp_path, "scheduler.type=ray", "cluster.n_nodes=2", "compile.allocation=gen:d2 | train:d2")
    mesh = plan.node("train_step").mesh
    assert mesh.label() == "n0-1"
    # each machine's bundle (one device) holds one replica and one share of the trainer: half a device each
    assert _layout(plan) == {"generate/0": (mesh, 0, 2), "generate/1": (mesh, 1, 2),
                             "train_step/0": (mesh, 0, 2), "train_step/0@n1": (mesh, 1, 2)}


def test_a_forward_only_node_spanning_machines_is_refused_at_compile_on_ray(tmp_path):
    allocation = "compile.allocation=gen:d1 + train:d1 + logprobs:d2 + reward:d1"  # logprobs on n2-3: one actor
    with pytest.raises(AllocationError, match=r"node 'logprobs': ray-one-machine: its mesh n2-3 spans 2 machines "
                                              r"but runs as 1 actor\(s\) on Ray"):
        _plan(tmp_path, "scheduler.type=ray", "cluster.n_nodes=5", allocation, graph="arith_grpo_ref_rm")
    assert _plan(tmp_path, "scheduler.type=local", "cluster.n_nodes=5", allocation,
                 graph="arith_grpo_ref_rm").allocation == "gen:d1 + train:d1 + logprobs:d2 + reward:d1"


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


def test_a_forward_only_node_pinned_to_two_machines_shares_the_trainers_mesh_on_ray(tmp_path):
    # compile.pins.logprobs=d2 on one-device machines: alone, the reference model's mesh would span two machines
    # as one actor (refused); the search on Ray finds the local scheduler's plan, which time-shares the trainer's.
    pins = ("cluster.n_nodes=5", "compile.pins.logprobs=d2")
    local = _plan(tmp_path, "scheduler.type=local", *pins, graph="arith_grpo_ref_rm")
    on_ray = _plan(tmp_path, "scheduler.type=ray", *pins, graph="arith_grpo_ref_rm")
    assert on_ray.allocation == local.allocation == "gen:d2 + logprobs:d2 | reward:d2 | train:d2"
    mesh = on_ray.node("train_step").mesh
    assert on_ray.node("logprobs").mesh == mesh and mesh.label() == "n2-3"
    layout = _layout(on_ray)
    assert (layout["train_step/0"], layout["train_step/0@n1"]) == ((mesh, 0, 1), (mesh, 1, 1))
