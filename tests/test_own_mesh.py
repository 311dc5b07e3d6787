"""Any node on its own mesh (issue 24): step groups chained by ``compiler.hosting``.

PPO's critic on a mesh of its own (``gen:d1 + train:d1 + critic_step:d1``): the advantage
node, a forward-only call of the critic, follows ``critic_step`` to that mesh, so the chain is
``critic_step`` (advantage, critic_step) then ``train_step``. A real run ends and trains
every sample once within k, under both schedulers, which pick the same groups; a step group
after the policy's trainer (a second model trained on the same advantages) gets every batch
and the run waits for it; what the chain cannot run is refused by the compiler and by the
runtime, naming the node and the rule. Expected counts are steps x B x n by hand.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from areal_flow.config_load import load_config
from areal_flow.ops.registry import BATCH, GROUP, SOURCE, STREAM
from compiler.allocation import AllocationError
from compiler.hosting import Hosted, hosting_problem, step_groups
from runs import REPO, cli_run, records
from runtime.topology import TopologyError, build_topology

TINY = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false",
        "async.max_staleness=1"]
OWN = ["cluster.n_gpus_per_node=3", "compile.allocation=gen:d1 + train:d1 + critic_step:d1"]


def _plan(tmp_path, *overrides: str):
    from areal_flow.cli import load_flow
    from compiler.program import compile_program

    cfg = load_config(REPO / "graphs/arith_ppo.yaml", [*TINY, *overrides, f"out_dir={tmp_path}", "name=own"])
    return compile_program(load_flow(REPO / "graphs/arith_ppo.py")(cfg), cfg)


def test_the_critic_takes_its_advantage_to_its_own_mesh_and_the_batch_flows_down_the_chain(tmp_path):
    plan = _plan(tmp_path, *OWN)
    assert plan.allocation == "gen:d1 + train:d1 + critic_step:d1 | advantage:d1"
    topo = build_topology(plan)
    assert [g.name for g in topo.step_groups] == ["critic_step", "train_step"]
    assert topo.groups["critic_step"].nodes == ["advantage", "critic_step"]
    assert topo.groups["train_step"].nodes == ["train_step"]
    # replicas -> critic group (per prompt group) -> policy trainer (whole batches)
    assert topo.generation.downstream == ["critic_step"]
    assert topo.groups["critic_step"].upstream == ["generate"]
    assert topo.groups["critic_step"].downstream == ["train_step"]
    assert topo.groups["train_step"].upstream == ["critic_step"]
    assert topo.trainer.name == "train_step"  # it trains 'policy', the generator's model


def test_a_critic_group_spawns_the_critic_steps_ranks_not_its_first_nodes(tmp_path):
    # the advantage node comes first on the critic's mesh with a strategy of its own (forward-only:
    # it runs on rank 0); the group's ranks are the critic's train_step's, d2 (2 processes)
    plan = _plan(tmp_path, "cluster.n_gpus_per_node=4", "compile.allocation=gen:d1 + train:d1 + "
                 "advantage:d1p2 | critic_step:d2")
    group = build_topology(plan).groups["critic_step"]
    assert group.nodes == ["advantage", "critic_step"]
    assert group.strategy.short() == "d2"


def test_the_local_and_ray_schedulers_choose_the_same_groups(tmp_path):
    from runtime.driver import reports, run_ends
    from runtime.launch import LocalScheduler
    from runtime.ray_scheduler import RayScheduler, _settings
    from runtime.run_setup import RunSetup

    plan = _plan(tmp_path, *OWN)
    topo = build_topology(plan)
    assert run_ends(topo) == {"critic_step/0", "train_step/0"}
    assert [g.name for g in topo.groups.values() if reports(topo, g)] == ["train_step"]
    setup = RunSetup(plan, topo, tmp_path / "own", show_progress=False)
    spec = {name: SimpleNamespace(group=name, rank=0, plan=plan) for name in topo.groups}

    local, started = LocalScheduler(setup), {}
    local.ctx = SimpleNamespace(Process=lambda target, args, name: started.setdefault(name, (args, SimpleNamespace(
        start=lambda: None)))[1])
    local.procs, local.leases, local.results = {}, {}, object()
    local.reports = SimpleNamespace(put="metrics sink")
    ray_runs = {}

    class _Actor:
        def __init__(self, name):
            self.run = SimpleNamespace(remote=lambda spec, generation, sink: ray_runs.setdefault(name, sink))

    ray = RayScheduler(setup, _settings(plan))
    ray.actors = {f"{g}/0": _Actor(f"{g}/0") for g in topo.groups}
    ray.sink, ray.pending = "metrics sink", {}
    for name, group in topo.groups.items():
        local.start(spec[name], group)
        ray.start(spec[name], group)
    local_sinks = {name: args[-2] if topo.groups[name.split("/")[0]].kind != "generation" else None
                   for name, (args, _) in started.items()}
    expected = {"generate/0": None, "critic_step/0": None, "train_step/0": "metrics sink"}
    assert local_sinks == expected
    assert ray_runs == expected


def _check_own_mesh_run(out: Path) -> None:
    """The accounting of a TINY run with the critic's step group before the policy's trainer."""
    trained = records(out)
    assert len(trained) == 3 * 2 * 4  # steps x B groups x n samples, by hand
    assert len({t["sample_id"] for t in trained}) == 24  # each sample once
    assert [t["step"] for t in trained] == [s for s in range(3) for _ in range(8)]
    assert max(t["staleness"] for t in trained) <= 1  # k
    workers = json.loads((out / "summary.json").read_text())["workers"]
    for name in ("critic_step/0", "train_step/0"):  # both step groups ran every step on every sample
        assert (workers[name]["steps"], workers[name]["consumed"], workers[name]["groups"]) == (3, 24, 6)
        assert workers[name]["max_staleness_seen"] <= 1
    assert (out / "critic" / "config.json").exists()  # the critic group saved its model
    assert _scalars(out, "train/value_loss") == [0, 1, 2]  # the critic's stats reach the trainer's steps


@pytest.mark.slow
@pytest.mark.ci
def test_a_critic_on_its_own_mesh_trains_every_sample_once_within_k_and_the_run_ends_on_ray(tmp_path):
    cli_run(REPO / "graphs" / "arith_ppo.py", *TINY, *OWN, f"out_dir={tmp_path}", "name=own",
            "scheduler.threads_per_worker=1", "scheduler.type=ray", timeout_s=400)  # a hang fails, by timeout
    _check_own_mesh_run(tmp_path / "own")


@pytest.mark.slow
def test_a_critic_on_two_ranks_of_its_own_mesh_trains_as_on_one(tmp_path):
    # the same run with the critic on one process and on 2 ranks (dp2, FSDP2) of a mesh of its own
    # (runtime.trainer_ranks spawns them for the critic's group): both train every sample once and
    # end; step 0's batch (the first B groups admitted, sampled by version 0) and the critic's
    # version 0 are the same in both, so its value loss and gradient norm agree within fp32
    # reduction order (FSDP sums two halves; relative 1e-5, as tests/rl_step_cases.py argues)
    runs = {}
    for label, devices, critic in (("one", 3, "d1"), ("two", 4, "d2")):
        cli_run(REPO / "graphs" / "arith_ppo.py", *TINY, f"cluster.n_gpus_per_node={devices}",
                f"compile.allocation=gen:d1 + train:d1 + critic_step:{critic}", f"out_dir={tmp_path}",
                f"name={label}", "scheduler.threads_per_worker=1", timeout_s=400)
        out = tmp_path / label
        _check_own_mesh_run(out)
        plan = json.loads((out / "plan.json").read_text())
        assert plan["allocation"] == f"gen:d1 + train:d1 + critic_step:{critic} | advantage:{critic}"
        runs[label] = json.loads((out / "steps.jsonl").read_text().splitlines()[0])
    for key in ("train/value_loss", "train/critic_grad_norm"):
        assert runs["two"][key] == pytest.approx(runs["one"][key], rel=1e-5), key


SECOND = '''
from areal_flow import Model, flow, ops
from areal_flow.blocks import sample_groups, train_policy


@flow
def second(cfg):  # GRPO whose advantages also train a second model, on a mesh of its own
    policy, other = Model("policy", cfg.model), Model("other", cfg.model)
    rollout = sample_groups(policy, cfg)
    adv = ops.advantage(rollout, ops.reward(rollout, fn="arithmetic"), estimator="grpo")
    stats = train_policy(policy, adv, rollout, cfg, algorithm="grpo")
    ops.train_step(other, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness, name="other_step")
    return stats
'''


@pytest.mark.slow
def test_a_step_group_after_the_policys_trainer_gets_every_batch_and_the_run_waits_for_it(tmp_path):
    graph = tmp_path / "second.py"
    graph.write_text(SECOND)
    cli_run(graph, "--config", str(REPO / "graphs" / "arith_grpo.yaml"), *TINY, "cluster.n_gpus_per_node=3",
            "compile.allocation=gen:d1 + train:d1 + other_step:d1", f"out_dir={tmp_path}", "name=second",
            timeout_s=400)
    out = tmp_path / "second"
    plan = json.loads((out / "plan.json").read_text())
    assert {n["name"]: n.get("placed_with") for n in plan["nodes"]}["advantage"] == "train_step"  # chain: T -> other
    assert len({t["sample_id"] for t in records(out)}) == 3 * 2 * 4
    workers = json.loads((out / "summary.json").read_text())["workers"]
    assert (workers["other_step/0"]["steps"], workers["other_step/0"]["consumed"]) == (3, 24)  # after the trainer
    assert workers["other_step/0"]["max_staleness_seen"] <= 1
    assert (out / "other" / "config.json").exists()  # it finished: the run waited for its end


def _scalars(out: Path, tag: str) -> list[int]:
    """The steps at which ``tag`` was logged in the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_compile_refuses_a_critics_advantage_away_from_its_trainer(tmp_path):
    with pytest.raises(AllocationError, match=r"node 'advantage': stale-weights: .*'critic_step' trains"):
        _plan(tmp_path, "cluster.n_gpus_per_node=3",
              "compile.allocation=gen:d1 + train:d1 | advantage:d1 + critic_step:d1")
    assert _plan(tmp_path, *OWN, "train.checkpoint_every=1").allocation.startswith(OWN[1].split("=")[1])  # issue 24


def test_run_refuses_it_before_any_process_starts(tmp_path):
    from runtime.launch import run

    plan = _plan(tmp_path, *OWN)
    train_mesh = next(n.mesh for n in plan.nodes if n.name == "train_step")
    moved = tuple(dataclasses.replace(n, mesh=train_mesh) if n.name == "advantage" else n for n in plan.nodes)
    bad = dataclasses.replace(plan, nodes=moved)  # advantage on the policy's mesh, its critic trained elsewhere
    with pytest.raises(TopologyError, match=r"advantage.*stale-weights: it runs model 'critic'"):
        build_topology(bad)
    with pytest.raises(TopologyError, match="stale-weights"):
        run(bad, show_progress=False)
    assert not (tmp_path / "own").exists()  # no run folder, no worker


def test_the_search_never_emits_a_layout_the_predicate_refuses(tmp_path, monkeypatch):
    import compiler.search as search

    def no_shared_mesh(nodes):  # a stand-in rule: refuse any layout that co-locates gen and train
        groups = {n.group for n in nodes if n.name == "generate"} & {n.group for n in nodes if n.name == "train_step"}
        return ("train_step", "test rule") if groups or ("generation", "generate") not in {n.group for n in nodes} \
            else None

    monkeypatch.setattr(search, "hosting_problem", no_shared_mesh)
    plan = _plan(tmp_path, "cluster.n_gpus_per_node=4")
    assert plan.alternatives and all(" + " in a.allocation for a in plan.alternatives)
    monkeypatch.setattr(search, "hosting_problem", lambda nodes: ("train_step", "test rule"))
    with pytest.raises(Exception, match="fit|feasible|no "):
        _plan(tmp_path, "cluster.n_gpus_per_node=4")


def _n(name, grain, group, *inputs, model=None, trains=False):
    return Hosted(name, grain, group, inputs, model, trains)


PPO = [_n("data", SOURCE, None), _n("gen", STREAM, "G", "data", model="pi"), _n("rew", GROUP, "G", "gen"),
       _n("adv", BATCH, "C", "gen", "rew", model="v"), _n("train", BATCH, "T", "adv", model="pi", trains=True),
       _n("critic", BATCH, "C", "adv", model="v", trains=True)]


@pytest.mark.parametrize("change, node, rule", [
    ({}, None, None),  # the chain C -> T
    ({"adv": _n("adv", BATCH, "T", "gen", "rew", model="v")}, "adv", "stale-weights"),
    ({"rew": _n("rew", BATCH, "G", "gen")}, "rew", "batch-in-generation"),
    ({"rew": _n("rew", GROUP, "R", "adv")}, "rew", "later-group"),
])
def test_each_rule_names_its_node(change, node, rule):
    nodes = [change.get(n.name, n) for n in PPO]
    problem = hosting_problem(nodes)
    assert (problem and (problem[0], problem[1].split(":")[0])) == ((node, rule) if node else None)


def test_a_multi_rank_critic_on_the_policys_mesh_with_another_strategy_is_refused_by_rule(tmp_path):
    from compiler.strategy import ParallelStrategy

    d1, d2, t2 = ParallelStrategy(dp=1), ParallelStrategy(dp=2), ParallelStrategy(tp=2)

    def critic_at(group, s, train_s=d2):
        nodes = [dataclasses.replace(n, strategy=train_s) if n.name == "train" else n for n in PPO]
        return [dataclasses.replace(n, group=group, strategy=s, critic=True) if n.name == "critic" else
                dataclasses.replace(n, group=group) if n.name == "adv" else n for n in nodes]  # adv: with its trainer

    assert hosting_problem(critic_at("C", d1)) is None  # one process on its own mesh
    assert hosting_problem(critic_at("C", d2)) is None  # two processes on its own mesh: ranks of its own
    assert hosting_problem(critic_at("T", d2)) is None  # on the policy's ranks, with its strategy
    problem = hosting_problem(critic_at("T", t2))  # on the policy's ranks, another strategy
    assert (problem[0], problem[1].split(":")[0]) == ("critic", "critic-ranks")
    plan = _plan(tmp_path, "cluster.n_gpus_per_node=3", "compile.allocation=train:d2 | critic_step:d2 + gen:d1")
    edited = dataclasses.replace(plan, nodes=tuple(dataclasses.replace(n, strategy="t2") if n.name == "critic_step"
                                                   else n for n in plan.nodes))  # hand-edited: the runtime asks too
    with pytest.raises(TopologyError, match=r"node 'critic_step'.*critic-ranks: .*\(d1t2\).*\(d2;"):
        build_topology(edited)


def test_a_group_node_after_the_first_step_group_or_fed_by_one_is_refused_and_the_chain_is_in_data_order():
    fed = hosting_problem([*PPO, _n("judge", GROUP, "J", "critic", model="j")])
    assert fed[0] == "judge" and fed[1].startswith("batch-to-group")
    late = hosting_problem([*PPO, _n("score", GROUP, "T", "gen")])  # per group, in the second step group
    assert late[0] == "score" and late[1].startswith("group-after-batch")
    assert step_groups(PPO) == ["C", "T"]
