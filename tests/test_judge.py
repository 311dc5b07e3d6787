"""A second generating model, a frozen LLM judge (issue 24): ``graphs/arith_grpo_judge.py``.

The judge is a ``generate`` node whose prompts a per-group node builds from the policy's
rollouts (``runtime.topology.judge_nodes``); it runs per prompt group in a worker group of
its own (``runtime.executors.fed_generate``), on its own mesh or time-sharing one. The plan
compiles both ways; a real run ends and trains every sample once; the judge's text, parsed
into a reward, reaches the advantages (values by hand); shapes the runtime cannot run are
refused by the compiler and by the runtime, naming the node.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from areal_flow.config_load import load_config
from areal_flow.ops.registry import GROUP, SOURCE, STREAM
from areal_flow.types import Trajectory
from areal_flow.values import PortValueError, Rollouts, port_value
from compiler.allocation import AllocationError
from compiler.errors import InfeasiblePlanError
from compiler.hosting import Hosted, hosting_problem
from runs import REPO, cli_run, records
from runtime.topology import TopologyError, build_topology, judge_nodes

GRAPH = REPO / "graphs" / "arith_grpo_judge.py"
TINY = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false",
        "async.max_staleness=1"]


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(REPO / "graphs/arith_grpo_judge.yaml", [*TINY, *overrides, f"out_dir={tmp_path}", "name=judge"])


def _plan(tmp_path: Path, *overrides: str, graph: Path = GRAPH):
    from areal_flow.cli import load_flow
    from compiler.program import compile_program

    cfg = _cfg(tmp_path, *overrides)
    return compile_program(load_flow(graph)(cfg), cfg)


def test_the_judge_on_its_own_mesh_is_a_per_group_worker_group_between_generation_and_training(tmp_path):
    plan = _plan(tmp_path)
    assert plan.allocation == "gen:d1 + judge:d1 + train:d1"
    assert judge_nodes(plan) == ["judge"]
    topo = build_topology(plan)
    assert topo.generate.name == "generate" and topo.dataset.name == "dataset"
    assert {n: (g.kind, g.nodes) for n, g in topo.groups.items()} == {
        "generate": ("generation", ["generate", "judge_prompts"]),
        "judge": ("stage", ["judge", "reward"]),
        "train_step": ("stage", ["advantage", "train_step"])}
    assert topo.groups["judge"].upstream == ["generate"]
    assert topo.groups["train_step"].upstream == ["generate", "judge"]
    assert topo.routes == [("train_step", "generate")]  # no weight route reaches the frozen judge
    assert [g.name for g in topo.step_groups] == ["train_step"]


@pytest.mark.parametrize("allocation, shared", [("gen:d1 | judge:d1 + train:d1", "generate"),
                                                ("gen:d1 + judge:d1 | train:d1", "train_step")])
def test_the_judge_time_sharing_a_mesh_keeps_its_own_worker_group(tmp_path, allocation, shared):
    plan = _plan(tmp_path, "cluster.n_gpus_per_node=2", f"compile.allocation={allocation}")
    mesh = {n.name: n.mesh for n in plan.nodes}
    assert mesh["judge"] == mesh[shared]
    topo = build_topology(plan)
    assert topo.groups["judge"].kind == "stage" and topo.groups["judge"].nodes == ["judge", "reward"]
    assert topo.groups["train_step"].nodes == ["advantage", "train_step"]


def test_the_search_places_the_judge_too(tmp_path):
    plan = _plan(tmp_path, "cluster.n_gpus_per_node=2", "compile.allocation=")
    topo = build_topology(plan)  # whatever the search chose, the runtime runs it
    assert "judge" in topo.groups and topo.generation.name == "generate"


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["local", "ray"])
def test_a_judge_graph_runs_end_to_end_and_trains_every_sample_once(tmp_path, scheduler):
    cli_run(GRAPH, *TINY, f"out_dir={tmp_path}", "name=judge", "scheduler.threads_per_worker=1",
            f"scheduler.type={scheduler}", timeout_s=400)  # a hang fails, by timeout
    trained = records(tmp_path / "judge")
    assert len(trained) == 3 * 2 * 4  # steps x B groups x n samples, by hand
    assert len({t["sample_id"] for t in trained}) == 24  # each sample once
    assert [t["step"] for t in trained] == [s for s in range(3) for _ in range(8)]
    assert max(t["staleness"] for t in trained) <= 1  # k
    assert all(t["reward"] in (0.0, 1.0) for t in trained)  # the judge's verdicts, parsed


VERDICT_LENGTH = '''

def verdict_length(output_text, answer):  # the judge's text, whatever it says, as the reward
    return 10.0 + len(output_text)
'''


@pytest.mark.slow
def test_in_a_real_run_the_trained_rewards_are_the_judges_text(tmp_path):
    graph = tmp_path / "judge_length.py"  # the shipped graph, its reward the length of the judge's verdict
    text = GRAPH.read_text().replace('fn="arithmetic"', "fn=verdict_length")
    text = text.replace("\n\n@flow", VERDICT_LENGTH + "\n\n@flow")
    graph.write_text(text)
    (tmp_path / "judge_length.yaml").write_text(f"base: {REPO / 'graphs/arith_grpo_judge.yaml'}\n")
    cli_run(graph, *TINY, f"out_dir={tmp_path}", "name=judge", "scheduler.threads_per_worker=1", timeout_s=400)
    rewards = [t["reward"] for t in records(tmp_path / "judge")]
    assert len(rewards) == 24
    # 10 + the 0 to max_new_tokens = 5 characters of the judge's greedy answer: only the judge's reward
    # node computes these (a rule reward of the policy's own text is 0 or 1), and the policy's trainer took them
    assert all(r == int(r) and 10 <= r <= 15 for r in rewards)


def _trajectory(i: int, prompt: str, text: str, answer: str = "", index: int = 0) -> Trajectory:
    return Trajectory(sample_id=f"{index}:{i}", group_id=index, prompt_ids=[1, 5], output_ids=[5, 2],
                      behavior_logprobs=[-1.0, -1.0], versions=[0, 0], finish_reason="stop", prompt_text=prompt,
                      output_text=text, meta={"answer": answer, "problem_id": 7, "attempt": 1})


class _Judge:
    """A stand-in engine of the judge: answers each prompt with a fixed text (the stream protocol)."""

    def __init__(self, node, answers: list[str], lose: int | None = None) -> None:
        self.node, self.answers, self.lose, self.pending = node, answers, lose, []

    def submit(self, index, attempt, problem):
        self.pending.append((index, attempt, problem))

    def has_work(self):
        return bool(self.pending)

    def step(self):
        index, attempt, problem = self.pending.pop(0)
        kept = [] if index == self.lose else [_trajectory(0, problem["prompt"], self.answers[index], problem["answer"],
                                                          index)]
        return [(index, attempt, Rollouts(kept))]


def _judged_advantages(tmp_path: Path, answers: list[str], lose: int | None = None):
    """The group nodes of the judge graph (judge_prompts on the policy's replica, then the judge and
    its reward) on one hand-made group, then the advantage node: (rewards, advantages) or None."""
    from areal_flow.models.tokenizer import build_char_tokenizer
    from runtime.context import WorkerContext
    from runtime.executors.advantage import AdvantageExecutor
    from runtime.executors.fed_generate import FedGenerateExecutor
    from runtime.groups import GroupItem, run_group_nodes
    from runtime.workers import make_executor

    plan = _plan(tmp_path)
    ctx = WorkerContext(plan, {}, tmp_path, _tokenizer=build_char_tokenizer())
    policy = Rollouts([_trajectory(i, "3+4=", text, "7", index=5) for i, text in enumerate(["7", "8", "7", "9"])])
    item = GroupItem(5, 1, {"generate.rollouts": policy})
    nodes = [ctx.node(n) for n in ("judge_prompts", "judge", "reward")]
    executors = {"judge_prompts": make_executor(nodes[0], ctx), "reward": make_executor(nodes[2], ctx),
                 "judge": FedGenerateExecutor(_Judge(nodes[1], answers, lose))}
    if not run_group_nodes(item, nodes, executors):
        return None
    assert [t.sample_id for t in item.values["judge.rollouts"]] == ["5:0", "5:1", "5:2", "5:3"]
    assert [t.meta["answer"] for t in item.values["judge.rollouts"]] == ["7", "8", "7", "9"]  # the policy's answers
    adv = AdvantageExecutor(ctx.node("advantage"), ctx).run(
        {"rollouts": [item.values["generate.rollouts"]], "rewards": [item.values["reward.rewards"]]}, {})["advantages"]
    on_response = adv.batch["loss_mask"].argmax(dim=1)  # each row's first response token
    return list(item.values["reward.rewards"]), adv.batch["advantages"][range(4), on_response].tolist()


def test_the_judges_text_parsed_into_a_reward_reaches_the_advantages(tmp_path):
    rewards, adv = _judged_advantages(tmp_path, ["7", "7", "7", "7"])  # the judge says 7: samples 0 and 2 agree
    assert rewards == [1.0, 0.0, 1.0, 0.0]
    # mean 0.5, sample std sqrt(4 x 0.25 / 3) = 0.57735: A = +-0.5 / 0.57735 = +-0.86603
    assert adv == pytest.approx([0.86603, -0.86603, 0.86603, -0.86603], abs=1e-4)
    rewards, adv = _judged_advantages(tmp_path, ["8", "8", "8", "8"])  # another verdict, other advantages
    assert rewards == [0.0, 1.0, 0.0, 0.0]
    # mean 0.25, sample std sqrt((3 x 0.0625 + 0.5625) / 3) = 0.5: A = (r - 0.25) / 0.5
    assert adv == pytest.approx([-0.5, 1.5, -0.5, -0.5], abs=1e-4)
    assert _judged_advantages(tmp_path, ["7", "7", "7", "7"], lose=2) is None  # a lost verdict drops the group


def test_a_judge_given_other_than_one_prompt_per_sample_stops_naming_the_node(tmp_path):
    from runtime.executors.fed_generate import FedGenerateExecutor

    node = _plan(tmp_path).node("judge")
    judge = FedGenerateExecutor(_Judge(node, ["7"] * 3))
    prompts = [{"id": 1, "prompt": "3+4=", "answer": "7"}] * 3
    with pytest.raises(PortValueError, match=r"node 'judge'.*3 prompts for a group of 4 samples"):
        judge.run({"prompts": prompts}, {"index": 0, "attempt": 1, "samples": 4})
    assert len(judge.run({"prompts": prompts}, {"index": 0, "attempt": 1, "samples": 3})["rollouts"]) == 3
    with pytest.raises(PortValueError, match="3 prompts for its 4 samples"):
        port_value("prompts", prompts, 4)  # a per-group prompts value: one per sample


def _n(name, grain, group, *inputs, model=None, trains=False, samples=1, routed=False):
    return Hosted(name, grain, group, inputs, model, trains, samples=samples, routed=routed)


JUDGED = [_n("data", SOURCE, None), _n("gen", STREAM, "G", "data", model="pi"), _n("ask", GROUP, "G", "gen"),
          _n("judge", STREAM, "J", "ask", model="j"), _n("rew", GROUP, "J", "judge")]


@pytest.mark.parametrize("extra, node, rule", [
    ([], None, None),
    ([_n("gen2", STREAM, "H", "data", model="pi")], "gen2", "one-dataset"),
    ([_n("data2", SOURCE, None)], "data2", "one-dataset"),
    ([_n("judge_step", "batch", "T", "rew", model="j", trains=True)], "judge", "frozen-judge"),
])
def test_each_judge_rule_names_its_node(extra, node, rule):
    problem = hosting_problem([*JUDGED, *extra])
    assert (problem and (problem[0], problem[1].split(":")[0])) == ((node, rule) if node else None)


@pytest.mark.parametrize("judge, rule", [(_n("judge", STREAM, "J", "ask", model="j", samples=2), "judge-one-sample"),
                                         (_n("judge", STREAM, "J", "ask", model="j", routed=True), "judge-no-route")])
def test_a_judge_sampling_twice_or_reached_by_weights_is_refused_by_rule(judge, rule):
    problem = hosting_problem([judge if n.name == "judge" else n for n in JUDGED])
    assert (problem[0], problem[1].split(":")[0]) == ("judge", rule)


@pytest.mark.parametrize("old, new, rule", [
    ("verdict = ops.generate(judge, asked, n_samples=1", "verdict = ops.generate(judge, asked, n_samples=2",
     "judge-one-sample"),
    ("verdict = ops.generate(judge, asked", "verdict = ops.generate(policy, asked", "judge-no-route"),
])
def test_compile_refuses_a_judge_the_runtime_cannot_run_naming_node_and_rule(tmp_path, old, new, rule):
    text = GRAPH.read_text().replace(old, new)
    if rule == "judge-no-route":  # the judge runs the policy and a second sync_weights reaches it
        text = text.replace("    ops.sync_weights(policy, to=rollout)\n",
                            "    ops.sync_weights(policy, to=rollout)\n    ops.sync_weights(policy, to=verdict)\n")
    graph = tmp_path / "bad_judge.py"
    graph.write_text(text)
    with pytest.raises(AllocationError, match=rf"node 'judge': {rule}: "):
        _plan(tmp_path, graph=graph)  # the YAML's allocation, gen:d1 + judge:d1 + train:d1
    with pytest.raises(InfeasiblePlanError, match=rf"no placement .* runs: .*node 'judge': {rule}: "):
        _plan(tmp_path, "compile.allocation=", graph=graph)  # the search: no layout of it runs


TWO_POLICIES = '''
from areal_flow import Model, flow, ops


@flow
def two(cfg):  # two generate nodes fed by the dataset: not a judge, refused
    policy = Model("policy", cfg.model)
    prompts = ops.dataset(cfg.dataset)
    rollout = ops.generate(policy, prompts, n_samples=cfg.gen.n_samples, max_new_tokens=cfg.gen.max_new_tokens)
    ops.generate(Model("other", cfg.model, trainable=False), prompts, n_samples=2, name="second")
    adv = ops.advantage(rollout, ops.reward(rollout, fn="arithmetic"), estimator="grpo")
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats
'''


def test_compile_and_run_refuse_what_the_runtime_cannot_run_naming_the_node(tmp_path):
    from runtime.launch import run

    graph = tmp_path / "two.py"
    graph.write_text(TWO_POLICIES)
    with pytest.raises(AllocationError, match=r"node 'second'.*one-dataset: .*'generate' is the generate node"):
        _plan(tmp_path, "cluster.n_gpus_per_node=3", "compile.allocation=gen:d1 + second:d1 + train:d1", graph=graph)
    plan = _plan(tmp_path)
    rewired = tuple(dataclasses.replace(n, inputs={"prompts": ("dataset", "prompts")}) if n.name == "judge" else n
                    for n in plan.nodes)
    with pytest.raises(TopologyError, match=r"one dataset and one generate node fed by it.*\(generate, judge"):
        build_topology(dataclasses.replace(plan, nodes=rewired))
    greedy = tuple(dataclasses.replace(n, attrs={**n.attrs, "n_samples": 2}) if n.name == "judge" else n
                   for n in plan.nodes)
    with pytest.raises(TopologyError, match=r"node 'judge'.*judge-one-sample: .*n_samples=1"):
        run(dataclasses.replace(plan, nodes=greedy), show_progress=False)
    assert not (tmp_path / "judge").exists()  # no run folder, no worker
