"""The rollout's ``gamma`` reaches the ``multi_turn`` estimator: lowered by the compiler into
the advantage node (``compiler.program.lower_attrs``), read by its executor; by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from areal_flow import Model, flow, ops
from areal_flow.config import ExperimentConfig
from areal_flow.envs.episode import Episode
from compiler.program import lower_attrs
from runtime.executors.advantage import AdvantageExecutor
from test_rollout import TOK, cid


def _multi_turn_graph(**advantage_kwargs):
    @flow
    def agent(cfg):
        policy = Model("policy", "tiny-arith")
        episodes = ops.rollout(policy, ops.dataset({"name": "support_desk"}), env="support_desk", max_turns=3,
                               gamma=0.5)
        adv = ops.advantage(episodes, estimator="multi_turn", **advantage_kwargs)
        stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=1)
        ops.sync_weights(policy, to=episodes)
        return stats

    return agent(None)


def test_the_rollouts_gamma_reaches_the_multi_turn_estimator_by_hand():
    """Rollout gamma 0.5 is lowered into the advantage node; turn rewards -0.1, -0.1, 1.0 give
    G_2 = 1, G_1 = -0.1 + 0.5 * 1 = 0.4, G_0 = -0.1 + 0.5 * 0.4 = 0.1 (at gamma 1: 0.8, 0.9, 1)."""
    graph = _multi_turn_graph()
    lower_attrs(graph, ExperimentConfig())
    (node,) = graph.nodes_of("advantage")
    assert node.attrs["gamma"] == 0.5
    ep = Episode(TOK, chat=False)
    ep.observe("go")
    for k, (r, obs) in enumerate(((-0.1, "ab"), (-0.1, "c"), (1.0, None))):
        ep.act([cid(str(k)), TOK.eos_token_id], [-0.5, -0.5], [0, 0], str(k), "stop")
        ep.reward(r)
        if obs:
            ep.observe(obs)
    plan_node = SimpleNamespace(name=node.name, model=None, attrs=dict(node.attrs), where=lambda: "advantage")
    ctx = SimpleNamespace(plan=SimpleNamespace(nodes=[]), pad_id=0,
                          generator=lambda: SimpleNamespace(attrs={"temperature": 1.0}))
    out = AdvantageExecutor(plan_node, ctx).run({"rollouts": [[ep.to_trajectory("0:0", 0, 0.5, {})]]}, {})
    batch = out["advantages"].batch
    assert batch["advantages"][0][batch["loss_mask"][0].bool()].tolist() == pytest.approx([0.1, 0.1, 0.4, 0.4, 1, 1])


def test_a_gamma_given_to_the_advantage_node_or_token_mode_keeps_its_own():
    for kwargs, gamma in (({"gamma": 0.9}, 0.9), ({"mode": "token"}, None)):
        graph = _multi_turn_graph(**kwargs)
        lower_attrs(graph, ExperimentConfig())
        assert graph.nodes_of("advantage")[0].attrs.get("gamma") == gamma
