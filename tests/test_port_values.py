"""Typed port values (issue 23) and a user op's result checked where it returns (issue 28).

* every port type of the built-in ops has a documented class in ``areal_flow.values``;
* one rule reads a user op's result: one output port -> the value; several -> a mapping
  whose keys are exactly the port names; a dict is never taken for a port map by guessing;
* a group op's per-sample output must hold one entry per trajectory of its group: 7
  rewards for a group of 8 stop with one line naming the op, the group and the lengths;
* a batch op receives the step's typed ``Advantages`` and returns it changed (clipping);
  returning the old ad-hoc dict names the op and the port;
* end to end through ``areal-flow run`` (slow): the clipped advantages are what the
  train_step received (``debug.record``), and the 7-of-8 op stops the run with that line.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from areal_flow.ops import OPS, register_op
from areal_flow.types import Trajectory
from areal_flow.values import PORT_TYPES, Advantages, PortValueError, Rewards, Rollouts
from runtime.groups import GroupItem, run_group_nodes
from runtime.workers import make_executor

REPO = Path(__file__).resolve().parents[1]
TINY = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false"]


@register_op("pv_seven_of_eight", inputs={"rollouts": "rollouts", "rewards": "rewards"}, outputs={"rewards": "rewards"})
def pv_seven_of_eight(rollouts, rewards):
    return list(rewards)[:-1]  # loses the last sample's reward


@register_op("pv_penalty", inputs={"rollouts": "rollouts", "rewards": "rewards"}, outputs={"rewards": "rewards"})
def pv_penalty(rollouts, rewards, coef=0.25):
    return [r - coef * len(t.output_ids) for t, r in zip(rollouts, rewards)]


@register_op("pv_port_map", inputs={"rewards": "rewards"}, outputs={"rewards": "rewards"})
def pv_port_map(rewards):
    return {"rewards": list(rewards)}  # a port map from a single-output op: the value is this dict


@register_op("pv_nan", inputs={"rewards": "rewards"}, outputs={"rewards": "rewards"})
def pv_nan(rewards):
    return [float("nan")] + list(rewards)[1:]


@register_op("pv_two", inputs={"rewards": "rewards"}, outputs={"rewards": "rewards", "note": "note"})
def pv_two(rewards, keys=("rewards", "note")):
    return {k: (list(rewards) if k == "rewards" else "kept as is") for k in keys}


@register_op("pv_clip", inputs={"advantages": "advantages"}, outputs={"advantages": "advantages"}, grain="batch")
def pv_clip(advantages, bound=1.0):
    clipped = advantages.batch["advantages"].clamp(-bound, bound)
    return dataclasses.replace(advantages, batch={**advantages.batch, "advantages": clipped})


@register_op("pv_clip_dict", inputs={"advantages": "advantages"}, outputs={"advantages": "advantages"}, grain="batch")
def pv_clip_dict(advantages):
    return {"batch": advantages.batch, "trajectories": advantages.trajectories, "stats": advantages.stats}


@register_op("pv_step_rewards", inputs={"rewards": "rewards"}, outputs={"rewards": "rewards"}, grain="batch")
def pv_step_rewards(rewards, drop_group=False, drop_sample=False):
    groups = [list(g) for g in rewards]
    if drop_sample:
        groups[1] = groups[1][:-1]
    return groups[:-1] if drop_group else groups


@register_op("pv_none", inputs={"rewards": "rewards"}, outputs={"rewards": "rewards"}, grain="batch")
def pv_none(rewards):
    return None


def _node(op: str, name: str | None = None, **attrs) -> SimpleNamespace:
    inputs = {p.name: ("reward" if p.name == "rewards" else "generate", p.name) for p in OPS[op].spec.inputs}
    return SimpleNamespace(name=name or op, op=op, source="g.py:9", attrs=attrs, inputs=inputs)


def _group(index: int, rewards: list[float]) -> GroupItem:
    trajectories = [Trajectory(f"{index}:{j}", index, [1], [5] * (j + 1), [-0.5] * (j + 1), [0] * (j + 1), "stop")
                    for j in range(len(rewards))]
    return GroupItem(index, 1, {"generate.rollouts": Rollouts(trajectories), "reward.rewards": Rewards(rewards)})


def _run(node, item: GroupItem) -> bool:
    return run_group_nodes(item, [node], {node.name: make_executor(node, ctx=None)})


def test_every_builtin_port_type_has_a_documented_class():
    types = {p.type for op in OPS.values() if op.builtin for p in (*op.spec.inputs, *op.spec.outputs)}
    assert types == {"prompts", "rollouts", "rewards", "logprobs", "advantages", "stats", "weights"}
    assert types <= set(PORT_TYPES) and all(PORT_TYPES[t].__doc__ for t in types)


def test_seven_rewards_for_a_group_of_eight_stop_with_one_line():
    node = _node("pv_seven_of_eight", name="short")
    with pytest.raises(PortValueError) as err:
        _run(node, _group(5, [1.0, 0.0] * 4))
    assert str(err.value) == ("op 'pv_seven_of_eight' (node 'short', g.py:9): port 'rewards' (rewards), group 5 "
                              "(admission index): 7 values for its 8 samples")


def test_a_list_of_floats_becomes_rewards_of_the_group():
    node = _node("pv_penalty")
    item = _group(3, [1.0, 0.0, 1.0, 0.0])  # responses of 1, 2, 3, 4 tokens
    assert _run(node, item)
    # r - 0.25 * tokens: 1 - 0.25, 0 - 0.5, 1 - 0.75, 0 - 1
    assert item.values["pv_penalty.rewards"] == Rewards([0.75, -0.5, 0.25, -1.0])


def test_a_single_output_op_returning_a_port_map_is_refused_naming_op_and_port():
    with pytest.raises(PortValueError) as err:
        _run(_node("pv_port_map"), _group(0, [1.0, 0.0]))
    assert str(err.value) == ("op 'pv_port_map' (node 'pv_port_map', g.py:9): port 'rewards' (rewards), group 0 "
                              "(admission index): got dict with keys ['rewards']; expected Rewards (or a list of "
                              "floats, one per sample)")


def test_a_non_finite_reward_is_refused_naming_the_sample():
    with pytest.raises(PortValueError, match=r"port 'rewards' \(rewards\), group 2 \(admission index\): sample 0 is "
                                             r"float nan; expected a finite float$"):
        _run(_node("pv_nan"), _group(2, [1.0, 0.0]))


def test_a_multi_output_op_returns_exactly_its_ports():
    item = _group(1, [1.0, 0.0])
    assert _run(_node("pv_two"), item)
    assert item.values["pv_two.rewards"] == Rewards([1.0, 0.0])
    assert item.values["pv_two.note"] == "kept as is"  # a type of the graph file's own: passed unchecked
    with pytest.raises(PortValueError) as err:
        _run(_node("pv_two", keys=("rewards",)), _group(1, [1.0, 0.0]))
    assert str(err.value) == ("op 'pv_two' (node 'pv_two', g.py:9) returned dict with keys ['rewards']; an op with "
                              "outputs rewards, note returns a mapping with exactly those keys")


def _advantages() -> Advantages:
    trajectories = [Trajectory(f"0:{j}", 0, [1], [5, 6], [-0.5, -0.5], [0, 0], "stop", reward=1.0) for j in range(2)]
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "advantages": torch.tensor([[0.0, 2.0, -3.0],
                                                                                          [0.0, 0.5, -0.25]])}
    return Advantages(batch, trajectories, {"kl_ref_in_reward": 0.1})


def test_a_batch_op_clips_the_typed_advantages_it_receives():
    node = _node("pv_clip", name="clip", bound=1.0)
    inputs = {"advantages": _advantages()}
    out = make_executor(node, ctx=None).run(inputs, {"step": 0, "indices": [0], "samples": [2]})
    # clamp to [-1, 1]: 2 -> 1, -3 -> -1, the others unchanged
    assert out["advantages"].batch["advantages"].tolist() == [[0.0, 1.0, -1.0], [0.0, 0.5, -0.25]]
    assert out["advantages"].trajectories is inputs["advantages"].trajectories
    assert out["advantages"].stats == {"kl_ref_in_reward": 0.1}
    with pytest.raises(PortValueError, match=r"port 'advantages' \(advantages\): 2 trajectories for its 4 samples"):
        make_executor(node, ctx=None).run(inputs, {"step": 0, "indices": [0, 1], "samples": [2, 2]})


def test_a_batch_op_returning_the_old_dict_names_op_and_port():
    node = _node("pv_clip_dict", name="clip")
    with pytest.raises(PortValueError) as err:
        make_executor(node, ctx=None).run({"advantages": _advantages()}, {"step": 0, "indices": [0], "samples": [2]})
    assert str(err.value) == ("op 'pv_clip_dict' (node 'clip', g.py:9): port 'advantages' (advantages): got dict with "
                              "keys ['batch', 'stats', 'trajectories']; expected Advantages (return the value received, "
                              "changed: dataclasses.replace(advantages, batch={...}))")


def test_a_batch_op_returns_one_per_sample_value_per_group():
    step = {"rewards": [Rewards([1.0, 0.0]), Rewards([0.0, 0.0, 1.0])]}
    info = {"step": 3, "indices": [6, 7], "samples": [2, 3]}
    out = make_executor(_node("pv_step_rewards"), ctx=None).run(step, info)
    assert out["rewards"] == [Rewards([1.0, 0.0]), Rewards([0.0, 0.0, 1.0])]
    with pytest.raises(PortValueError, match=r"port 'rewards' \(rewards\): 1 groups for a step of 2$"):
        make_executor(_node("pv_step_rewards", drop_group=True), ctx=None).run(step, info)
    with pytest.raises(PortValueError, match=r"group 7 \(admission index\): 2 values for its 3 samples$"):
        make_executor(_node("pv_step_rewards", drop_sample=True), ctx=None).run(step, info)
    with pytest.raises(PortValueError, match=r"returned None; a batch op returns its output rewards"):
        make_executor(_node("pv_none"), ctx=None).run(step, info)


CLIP_GRAPH = '''
import dataclasses

from areal_flow import Model, flow, ops
from areal_flow.ops import register_op


@register_op("length_penalty", inputs={"rollouts": "rollouts", "rewards": "rewards"}, outputs={"rewards": "rewards"})
def length_penalty(rollouts, rewards, coef=0.0):  # rewards that differ within a group: advantages are not all 0
    return [r - coef * len(t.output_ids) for t, r in zip(rollouts, rewards)]


@register_op("clip_advantages", inputs={"advantages": "advantages"}, outputs={"advantages": "advantages"},
             grain="batch")
def clip_advantages(advantages, bound=1.0):
    clipped = advantages.batch["advantages"].clamp(-bound, bound)
    return dataclasses.replace(advantages, batch={**advantages.batch, "advantages": clipped})


@flow
def clipped_grpo(cfg):
    policy = Model("policy", cfg.model)
    rollout = ops.generate(policy, ops.dataset(cfg.dataset), n_samples=cfg.gen.n_samples,
                           max_new_tokens=cfg.gen.max_new_tokens)
    rewards = length_penalty(rollout, ops.reward(rollout, fn="arithmetic"), coef=0.25)
    adv = clip_advantages(ops.advantage(rollout, rewards, estimator="grpo"), bound=0.5, name="clip")
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats
'''

SHORT_GRAPH = '''
from areal_flow import Model, flow, ops
from areal_flow.ops import register_op


@register_op("seven_of_eight", inputs={"rollouts": "rollouts", "rewards": "rewards"}, outputs={"rewards": "rewards"})
def seven_of_eight(rollouts, rewards):
    return list(rewards)[:-1]


@flow
def short_grpo(cfg):
    policy = Model("policy", cfg.model)
    rollout = ops.generate(policy, ops.dataset(cfg.dataset), n_samples=cfg.gen.n_samples,
                           max_new_tokens=cfg.gen.max_new_tokens)
    adv = ops.advantage(rollout, seven_of_eight(rollout, ops.reward(rollout, fn="arithmetic")), estimator="grpo")
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats
'''


def _cli_run(tmp_path: Path, graph: str, name: str, *overrides: str) -> subprocess.CompletedProcess:
    path = tmp_path / f"{name}.py"
    path.write_text(graph)
    return subprocess.run([sys.executable, "-m", "areal_flow.cli", "run", str(path), "--config",
                           str(REPO / "graphs/arith_grpo.yaml"), *TINY, f"out_dir={tmp_path}", f"name={name}",
                           *overrides], cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_a_batch_op_clipping_advantages_runs_and_the_train_step_gets_them_clipped(tmp_path, warm_cache):
    done = _cli_run(tmp_path, CLIP_GRAPH, "clip", "debug.record=[advantage->clip,clip->train_step]")
    assert done.returncode == 0, done.stderr[-2000:]
    record = tmp_path / "clip" / "record"
    clipped_any = False
    for step in range(3):
        before = torch.load(record / "advantage-clip" / f"step_{step}.pt", weights_only=False)["value"]
        received = torch.load(record / "clip-train_step" / f"step_{step}.pt", weights_only=False)["value"]
        assert isinstance(received, Advantages) and len(received.trajectories) == 2 * 4  # B = 2 groups of n = 4
        raw = before.batch["advantages"]
        # what the train_step received: every advantage moved into [-0.5, 0.5], the rest of the batch as it was
        assert torch.equal(received.batch["advantages"], torch.where(raw > 0.5, 0.5, torch.where(raw < -0.5, -0.5, raw)))
        assert all(torch.equal(received.batch[k], before.batch[k]) for k in before.batch if k != "advantages")
        assert [t.sample_id for t in received.trajectories] == [t.sample_id for t in before.trajectories]
        clipped_any |= bool((raw.abs() > 0.5).any())
    assert clipped_any  # the bound cut something (GRPO's z-scores of 4 differing rewards reach |z| >= 0.87)


@pytest.mark.slow
def test_seven_rewards_for_eight_samples_stop_the_run_with_one_line(tmp_path, warm_cache):
    done = _cli_run(tmp_path, SHORT_GRAPH, "short", "gen.n_samples=8")
    assert done.returncode == 1
    lines = [x for x in done.stderr.splitlines() if "PortValueError" in x]
    assert len(lines) == 1 and "Traceback" not in done.stderr
    line = next(i for i, text in enumerate(SHORT_GRAPH.splitlines(), 1) if "adv = " in text)
    assert lines[0].startswith(f"generate/0 failed: PortValueError: op 'seven_of_eight' (node 'seven_of_eight', "
                               f"{tmp_path / 'short.py'}:{line}): port 'rewards' (rewards), group ")
    assert lines[0].endswith(" (admission index): 7 values for its 8 samples")
    trained = tmp_path / "short" / "trajectories" / "trajectories.jsonl"
    assert not trained.exists() or not trained.read_text()  # no sample was trained
