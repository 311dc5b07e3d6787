"""A graph file that registers its own algorithm and estimator, for the tests that run it
(``test_plan_program.py``, ``test_ray_scheduler.py``), and the by-hand check of a run of it.

The file is written into the test's folder, so no worker can import it: the algorithm and
the estimator reach the workers by value in the plan (``plan.algorithms``, ``plan.estimators``).
"""

from __future__ import annotations

import glob
import json
from collections import defaultdict
from pathlib import Path

import pytest

USER_GRAPH = '''
from areal_flow import Model, flow, ops
from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.catalog import register_estimator
from areal_flow.algorithms.registry import register_algorithm


@register_estimator("centered")
def centered(rewards, group_ids, loss_mask):
    """r - mean of its group, on every response token (no std)."""
    from areal_flow.algorithms.returns import AdvantageOutput

    out = rewards.double().clone()
    for g in group_ids.unique():
        out[group_ids == g] -= rewards[group_ids == g].double().mean()
    return AdvantageOutput((out[:, None] * loss_mask).float(), None)


@register_algorithm("my_grpo")
class MyGRPO(BaseAlgorithm):
    """GRPO's clipped loss on centred rewards; it reports what it trained on."""

    default_estimator = "centered"
    policy_loss = "ppo"
    loss_defaults = {"clip_eps_high": 0.3}

    def update_parameters(self, batch, **kwargs):
        stats = super().update_parameters(batch, **kwargs)
        stats["user/advantage_abs_sum"] = float(batch["advantages"][batch["loss_mask"].bool()].abs().sum())
        stats["user/clip_eps_high"] = self.loss_cfg.clip_eps_high
        return stats


def text_reward(output_text, answer):
    """A reward that differs between the samples of a group: the answer's characters mod 7."""
    return float(sum(map(ord, output_text)) % 7)


@flow
def user_grpo(cfg):
    policy = Model("policy", cfg.model)
    rollout = ops.generate(policy, ops.dataset(cfg.dataset), n_samples=cfg.gen.n_samples,
                           max_new_tokens=cfg.gen.max_new_tokens)
    adv = ops.advantage(rollout, ops.reward(rollout, fn=text_reward))  # my_grpo's estimator: centered
    stats = ops.train_step(policy, adv, algorithm="my_grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats
'''


def write_user_graph(folder: Path) -> Path:
    """The graph file in ``folder`` (not importable by any worker)."""
    path = folder / "user_grpo.py"
    path.write_text(USER_GRAPH)
    return path


def scalars(out: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(out / "events*"))[-1])
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


def check_user_run(out: Path, steps: int) -> None:
    """The run in ``out`` trained with ``my_grpo`` on ``centered`` advantages: each step's sum
    of |advantage| is, by hand from its trajectories, sum_i |r_i - mean of i's group| x
    (response tokens of i) (GRPO's estimator would divide by the group's std); the loss config
    is the class's (clip_eps_high 0.3) and, with k = 2, the decoupled loss is on (its
    capped-weight metric is logged)."""
    rows = [json.loads(line) for line in (out / "trajectories" / "trajectories.jsonl").read_text().splitlines()]
    expected = []
    for step in range(steps):
        mine = [r for r in rows if r["step"] == step]
        groups = defaultdict(list)
        for r in mine:
            groups[r["group_id"]].append(r["reward"])
        expected.append(sum(abs(r["reward"] - sum(groups[r["group_id"]]) / len(groups[r["group_id"]]))
                            * len(r["output_ids"]) for r in mine))
    assert all(r["reward"] == sum(map(ord, r["output_text"])) % 7 for r in rows)  # the graph's own reward
    assert scalars(out, "user/advantage_abs_sum") == pytest.approx(expected, abs=1e-3) and sum(expected) > 0
    assert scalars(out, "user/clip_eps_high") == pytest.approx([0.3] * steps)
    assert len(scalars(out, "train/behavior_imp_weight_capped_frac")) == steps
