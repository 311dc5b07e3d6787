"""The search proposes a critic's train_step on several ranks (issue 24): on the policy train_step's
ranks with its strategy (``compiler.hosting``'s ``critic-ranks``) or on a mesh of its own with the
advantage node that reads it (a split layout, ``compiler.search``), when one process does not fit
or is slower, and a scaled-down copy of the plan it recommends for ``graphs/arith_ppo.py`` on
4 x 8 H100 runs through ``areal-flow compile --plan`` / ``areal-flow run --plan`` on CPU.

Memory by hand (``compiler.memory``'s formulas; ``P`` the critic's parameters, a dense model):
one process keeps ``16 P`` bytes of training states (bf16 weights and gradients, fp32 master
weights and Adam moments); on ``n`` ranks (ZeRO-3 over ``dp * cp``, split over ``tp * pp``) each
keeps ``16 P / n``, and rank 0 also the whole fp32 copy the advantage node reads, ``4 P``
(``compiler.cost.WHOLE_COPY_BYTES``). So a critic too big for one device fits on ``n`` ranks
only when ``16 P / n + 4 P`` is below the usable memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest

from areal_flow.cli import load_flow, main
from areal_flow.config_load import load_config
from compiler import InfeasiblePlanError
from compiler.executable import check_executable
from compiler.hardware import device_spec
from compiler.mesh import MeshSpec
from compiler.models import resolve_model
from compiler.program import compile_program
from compiler.strategy import ParallelStrategy
from runs import records as trained_records
from runtime.topology import build_topology
from test_moe_plan_scaled import scaled_down

REPO = Path(__file__).resolve().parents[1]
GRAPH = REPO / "graphs" / "arith_ppo.py"
GIB = 2**30
AT_SCALE = ["model.path=Qwen2.5-7B", "cluster.n_nodes=4", "cluster.n_gpus_per_node=8", "cluster.gpu=H100"]


def _compile(overrides: list[str]):
    cfg = load_config(REPO / "graphs" / "arith_ppo.yaml", overrides)
    return compile_program(load_flow(GRAPH)(cfg), cfg)


def _strategies(plan) -> dict[str, str]:
    return {n.name: n.strategy for n in plan.nodes if n.strategy}


def _devices(mesh) -> set:
    """The (machine, device) pairs of a plan node's mesh, as a ``MeshSpec`` or its JSON dict."""
    mesh = mesh if isinstance(mesh, MeshSpec) else MeshSpec(**mesh)
    return set(mesh.devices())


def _cli(*args) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main([str(a) for a in args])
    assert code == 0, err.getvalue()
    return out.getvalue()


def test_a_critic_too_big_for_one_device_is_sharded_on_a_mesh_of_its_own():
    critic = dataclasses.replace(resolve_model("Qwen2.5-7B"), head="scalar")
    p = critic.n_params  # 7.07e9: the policy's backbone with a 1-wide value head
    usable = 0.9 * device_spec("H100").memory_bytes  # compile.memory_fraction's default
    assert 16 * p > usable  # 105.4 GiB of states > 71.7 GiB: one process cannot hold it
    fewest = 16 * p / (usable - 4 * p)  # ranks n with 16 P / n + 4 P <= usable: n >= 2.3
    plan = _compile(["model.path=Qwen2.5-7B", "cluster.n_nodes=1", "cluster.n_gpus_per_node=8", "cluster.gpu=H100"])
    s = ParallelStrategy.parse(_strategies(plan)["critic_step"])
    critic, train, advantage = (plan.node(n) for n in ("critic_step", "train_step", "advantage"))
    assert not _devices(critic.mesh) & _devices(train.mesh)  # the split layout: its own devices
    assert advantage.mesh == critic.mesh  # the values are read where the critic trains (stale-weights)
    assert s.world_size >= fewest and s.world_size in (4, 8)  # an aligned mesh of at least 3 ranks
    memory = next(n for n in plan.nodes if n.name == "critic_step").memory
    assert memory["gradients"] == pytest.approx(2 * p / s.world_size)  # bf16, split over every rank
    assert memory["optimizer"] == pytest.approx(12 * p / s.world_size)
    assert memory["weights"] >= 2 * p / s.world_size + 4 * p  # its shard + rank 0's whole fp32 copy
    assert sum(memory.values()) <= usable
    check_executable(plan)
    build_topology(plan)  # the runtime's hosting check (critic-ranks) passes


def test_a_critic_whose_whole_copy_fits_no_device_is_refused_naming_the_copy():
    p = dataclasses.replace(resolve_model("Qwen2.5-32B"), head="scalar").n_params
    assert 4 * p > 0.9 * device_spec("H100").memory_bytes  # rank 0's copy alone (121 GiB) overflows
    assert 16 * p > 0.9 * device_spec("H100").memory_bytes  # and one process cannot hold it either
    with pytest.raises(InfeasiblePlanError, match=r"critic_step .*whole fp32 copy"):
        _compile(["model.path=Qwen2.5-32B", *AT_SCALE[1:]])


def test_a_small_critic_cannot_shorten_a_generation_bound_step():
    # tiny-arith (1 M parameters) on 2 machines of 2 H100: a step is bound by generation (its 5
    # decode steps at 2 ms overhead each), training takes under a millisecond, so neither
    # splitting the critic over ranks nor giving it a mesh of its own shortens the step
    plan = _compile(["cluster.n_nodes=2", "cluster.n_gpus_per_node=2", "cluster.gpu=H100"])
    assert plan.generation_s > plan.training_s
    one = _compile(["cluster.n_nodes=2", "cluster.n_gpus_per_node=2", "cluster.gpu=H100",
                    "compile.allocation=gen:d1 + advantage:d1 | train:d1 | critic_step:d1"])
    assert plan.generation_s == pytest.approx(one.generation_s)  # the same d1 generation, the step's bound
    assert plan.step_time_s <= one.step_time_s
    sharded = _compile(["cluster.n_nodes=2", "cluster.n_gpus_per_node=2", "cluster.gpu=H100",
                        "compile.allocation=gen:d2 + advantage:d2 | train:d2 | critic_step:d2"])
    assert sharded.step_time_s >= plan.step_time_s


def test_pinning_the_policy_leaves_the_critic_a_mesh_and_strategy_of_its_own():
    # the pin fixes the policy's strategy; the search still splits the critic off (a strategy of
    # its own on disjoint devices), which the runtime's hosting check accepts
    plan = _compile([*AT_SCALE, "compile.pins.train=d4t2"])
    strategies = _strategies(plan)
    assert strategies["train_step"] == "d4t2"
    assert not _devices(plan.node("critic_step").mesh) & _devices(plan.node("train_step").mesh)
    assert ParallelStrategy.parse(strategies["critic_step"]).world_size > 1
    build_topology(plan)


@pytest.fixture(scope="module")
def at_scale(tmp_path_factory):
    """``areal-flow compile --plan`` of arith_ppo with Qwen2.5-7B on 4 x 8 H100: (table, plan JSON)."""
    path = tmp_path_factory.mktemp("at_scale") / "plan.json"
    table = _cli("compile", GRAPH, *AT_SCALE, "--plan", "-o", path)
    return table, json.loads(path.read_text())


def test_compile_at_scale_shows_a_multi_rank_critic_on_a_mesh_of_its_own(at_scale):
    table, plan = at_scale
    nodes = {n["name"]: n for n in plan["nodes"]}
    critic, train = nodes["critic_step"], nodes["train_step"]
    assert ParallelStrategy.parse(critic["strategy"]).world_size > 1
    assert not _devices(critic["mesh"]) & _devices(train["mesh"])
    assert nodes["advantage"]["mesh"] == critic["mesh"]
    assert f"critic_step:{critic['strategy']}" in plan["allocation"]
    row = next(line for line in table.splitlines() if line.startswith("critic_step "))
    assert f" {critic['strategy']} " in row and "gather" in row
    check_executable(_compile([*AT_SCALE, f"compile.allocation={plan['allocation']}"]))


@pytest.mark.slow
def test_the_recommended_critic_scaled_down_runs(at_scale, tmp_path, warm_cache):
    # the recommended split layout, each strategy scaled down; the policy on one process (its
    # multi-rank runs are tested elsewhere) so that CPU runs 1 + 1 + the critic's ranks
    nodes = {n["name"]: n["strategy"] for n in at_scale[1]["nodes"] if n["strategy"]}
    k, strategy, advantage = 1, scaled_down(nodes["critic_step"]), scaled_down(nodes["advantage"])
    world = ParallelStrategy.parse(strategy).world_size
    plan_path = tmp_path / "plan.json"
    _cli("compile", GRAPH, "train.steps=2", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10",
         "eval.enabled=false", f"async.max_staleness={k}", f"out_dir={tmp_path}",
         f"cluster.n_gpus_per_node={world + 2}",
         f"compile.allocation=gen:d1 + train:d1 + critic_step:{strategy} | advantage:{advantage}",
         "--plan", "-o", plan_path)
    assert {n["name"]: n["strategy"] for n in json.loads(plan_path.read_text())["nodes"]}["critic_step"] == strategy
    _cli("run", "--plan", plan_path)
    records = trained_records(tmp_path / "arith_ppo")
    # 2 steps x 2 groups x 4 samples, each trained once, in its step's slot, at most k versions old
    assert len(records) == len({(r["group_id"], r["sample_id"]) for r in records}) == 2 * 2 * 4
    assert all(r["group_id"] // 2 == r["step"] for r in records)
    assert all(r["staleness"] <= k for r in records)
