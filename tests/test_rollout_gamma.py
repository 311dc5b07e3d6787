"""The rollout's ``gamma`` reaches the ``multi_turn`` estimator: lowered by the compiler into
the advantage node (``compiler.program.lower_attrs``), read by its executor; by hand."""

from __future__ import annotations


import pytest

from areal_flow import Model, flow, ops
from areal_flow.config import ExperimentConfig
from compiler.program import lower_attrs
from test_rollout import multi_turn_advantages


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
    adv, _ = multi_turn_advantages(node.name, node.attrs, 0.5)
    assert adv == pytest.approx([0.1, 0.1, 0.4, 0.4, 1, 1])


def test_a_gamma_given_to_the_advantage_node_or_token_mode_keeps_its_own():
    for kwargs, gamma in (({"gamma": 0.9}, 0.9), ({"mode": "token"}, None)):
        graph = _multi_turn_graph(**kwargs)
        lower_attrs(graph, ExperimentConfig())
        assert graph.nodes_of("advantage")[0].attrs.get("gamma") == gamma
