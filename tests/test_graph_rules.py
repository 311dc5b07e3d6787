"""The RL rules of graph validation (``areal_flow.graph_rules``) and the op-name typo:
each defect is one GraphError naming the node and the line of this file that made it."""

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from areal_flow import Model, flow, ops
from areal_flow.graph import GraphError

CFG = NS(dataset={"name": "arithmetic"})
ROOT = Path(__file__).resolve().parents[1]


def at(marker: str) -> str:
    """``test_graph_rules.py:N`` (regex-escaped) of the one line of this file ending in ``# marker``."""
    lines = Path(__file__).read_text().splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if line.endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return re.escape(f"test_graph_rules.py:{hits[0]}")


def _policy_loop(cfg, *, algorithm="grpo", estimator="grpo", critic=None, ref=None, sync=True):
    """dataset -> generate -> reward -> advantage -> train_step (-> sync_weights) of 'policy'."""
    policy = Model("policy", "tiny-arith")
    rollout = ops.generate(policy, ops.dataset(cfg.dataset))  # gen
    adv = ops.advantage(rollout, ops.reward(rollout), estimator=estimator, critic=critic, ref=ref)  # adv
    stats = ops.train_step(policy, adv, algorithm=algorithm, max_staleness=1)  # step
    if sync:
        ops.sync_weights(policy, to=rollout)
    return rollout, adv, stats


def test_algorithm_that_needs_a_critic_without_one():
    @flow
    def ppo_without_critic(cfg):
        return _policy_loop(cfg, algorithm="ppo")[2]

    with pytest.raises(GraphError, match=(
        rf"^node 'train_step' \(train_step, .*{at('step')}\): algorithm 'ppo' needs a critic, but node 'advantage' "
        rf"\(advantage, .*{at('adv')}\) reads none; pass ops.advantage\(..., estimator='gae', critic=")):
        ppo_without_critic(CFG)


def test_estimator_that_reads_values_without_a_critic():
    @flow
    def gae_without_critic(cfg):
        return _policy_loop(cfg, estimator="gae")[2]

    with pytest.raises(GraphError, match=(
        rf"^node 'advantage' \(advantage, .*{at('adv')}\): estimator 'gae' needs the values V\(s_t\) of a critic")):
        gae_without_critic(CFG)


def test_critic_with_an_estimator_that_gives_no_returns():
    @flow
    def critic_without_returns(cfg):
        critic = Model("critic", "tiny-arith")
        _, adv, stats = _policy_loop(cfg, algorithm="ppo", critic=critic)
        ops.train_step(critic, adv, algorithm="ppo", max_staleness=1)
        return stats

    with pytest.raises(GraphError, match=(
        rf"^node 'advantage' \(advantage, .*{at('adv')}\): critic 'critic' is trained on value targets, but "
        r"estimator 'grpo' gives no returns; use one of gae, reinforce_pp, reinforce_pp_baseline, multi_turn, or drop critic=$")):
        critic_without_returns(CFG)


def test_kl_in_reward_needs_a_ref_and_an_estimator_that_takes_the_kl():
    @flow
    def without_ref(cfg):
        return _policy_loop(cfg, algorithm="reinforce_pp", estimator="reinforce_pp")[2]

    @flow
    def kl_dropped(cfg):
        ref = Model("ref", "tiny-arith", trainable=False)
        return _policy_loop(cfg, algorithm="reinforce_pp", estimator="grpo", ref=ref)[2]

    with pytest.raises(GraphError, match=(
        rf"^node 'train_step' \(train_step, .*{at('step')}\): algorithm 'reinforce_pp' folds the KL to a reference "
        r"policy into the reward, but node 'advantage' .* reads none; pass ref=Model\('ref', ..., trainable=False\)$")):
        without_ref(CFG)
    with pytest.raises(GraphError, match=(
        rf"^node 'train_step' \(train_step, .*{at('step')}\): algorithm 'reinforce_pp' folds the KL into the reward, "
        r"but the estimator 'grpo' of node 'advantage' .* takes no KL; use one of reinforce_pp, reinforce_pp_baseline$")):
        kl_dropped(CFG)


def test_the_config_algorithm_switches_an_estimator_the_graph_left_to_it():
    from areal_flow.cli import load_flow
    from areal_flow.config_load import load_config

    flow_ = load_flow(ROOT / "graphs/arith_grpo.py")  # ops.advantage(rollout, reward): no estimator named
    for algorithm, estimator in (("grpo", "grpo"), ("rloo", "rloo"), ("lite_ppo", "lite_ppo"), ("dapo", "grpo")):
        graph = flow_(load_config(ROOT / "graphs/arith_grpo.yaml", [f"train.algorithm={algorithm}"]))
        assert graph.nodes["advantage"].attrs["estimator"] == estimator, algorithm
        assert graph.nodes["train_step"].attrs["algorithm"] == algorithm


def test_an_estimator_of_another_algorithm_is_one_line_naming_both_nodes():
    @flow
    def rloo_on_grpo_advantages(cfg):
        return _policy_loop(cfg, algorithm="rloo", estimator="grpo")[2]

    with pytest.raises(GraphError, match=(
        rf"^node 'advantage' \(advantage, .*{at('adv')}\) says estimator='grpo' \(the estimator of dapo, "
        rf"decoupled_ppo, grpo, gspo, m2po, sapo\), but node 'train_step' \(train_step, .*{at('step')}\) trains "
        r"algorithm='rloo', whose estimator is 'rloo': leave estimator= out \(the algorithm decides\) or train the "
        r"algorithm it belongs to$")):
        rloo_on_grpo_advantages(CFG)


def test_an_estimator_that_is_no_algorithms_default_goes_with_any():
    @flow
    def baseline_variant(cfg):  # REINFORCE++ with its group-baseline estimator (Hu 2025, sec. 3)
        ref = Model("ref", "tiny-arith", trainable=False)
        return _policy_loop(cfg, algorithm="reinforce_pp", estimator="reinforce_pp_baseline", ref=ref)[2]

    assert baseline_variant(CFG).nodes["advantage"].attrs["estimator"] == "reinforce_pp_baseline"


def test_an_estimator_left_to_the_algorithm_has_its_knobs_checked_and_needs_a_train_step():
    @flow
    def knob_of_another(cfg):
        policy = Model("policy", "tiny-arith")
        rollout = ops.generate(policy, ops.dataset(cfg.dataset))
        adv = ops.advantage(rollout, ops.reward(rollout), lam=0.9)  # knob
        stats = ops.train_step(policy, adv, algorithm="grpo")
        ops.sync_weights(policy, to=rollout)
        return stats

    with pytest.raises(GraphError, match=(
        rf"^node 'advantage' \(advantage, .*{at('knob')}\): unknown argument 'lam'; estimator 'grpo' \(the default "
        r"of algorithm 'grpo'\) takes: eps, std_unbiased$")):
        knob_of_another(CFG)

    @flow
    def nobody_takes_it(cfg):
        rollout = ops.generate(Model("policy", "tiny-arith"), ops.dataset(cfg.dataset))
        return ops.advantage(rollout, ops.reward(rollout))  # orphan

    with pytest.raises(GraphError, match=(
        rf"^node 'advantage' \(advantage, .*{at('orphan')}\): no estimator given and no train_step reads this node")):
        nobody_takes_it(CFG)


def test_user_registered_algorithm_is_accepted_and_checked_while_tracing():
    from areal_flow.algorithms import registry
    from areal_flow.algorithms.base import BaseAlgorithm

    @registry.register_algorithm("test_rules_actor_critic")
    class ActorCritic(BaseAlgorithm):
        default_estimator = "gae"
        requires_critic = True

    @flow
    def user_algorithm(cfg):
        critic = Model("critic", "tiny-arith")
        _, adv, stats = _policy_loop(cfg, algorithm="test_rules_actor_critic", estimator="gae", critic=critic)
        ops.train_step(critic, adv, algorithm="test_rules_actor_critic", max_staleness=1)
        return stats

    @flow
    def user_algorithm_without_critic(cfg):
        return _policy_loop(cfg, algorithm="test_rules_actor_critic")[2]

    try:
        assert user_algorithm(CFG).nodes["train_step"].attrs["algorithm"] == "test_rules_actor_critic"
        with pytest.raises(GraphError, match="algorithm 'test_rules_actor_critic' needs a critic"):
            user_algorithm_without_critic(CFG)
    finally:
        registry._REGISTRY.pop("test_rules_actor_critic")


def test_generator_of_a_trained_model_needs_its_weights():
    @flow
    def no_sync(cfg):
        return _policy_loop(cfg, sync=False)[2]

    with pytest.raises(GraphError, match=(
        rf"^node 'train_step' \(train_step, .*{at('step')}\): it updates model 'policy', but no "
        rf"ops.sync_weights\(policy, to=...\) sends the new weights to node 'generate' \(generate, .*{at('gen')}\)")):
        no_sync(CFG)


def test_two_sync_weights_to_one_generator():
    @flow
    def synced_twice(cfg):
        policy = Model("policy", "tiny-arith")
        rollout, _, stats = _policy_loop(cfg)  # first sync
        ops.sync_weights(policy, to=rollout)  # second sync
        return stats

    with pytest.raises(GraphError, match=(
        rf"^node 'sync_weights_1' \(sync_weights, .*{at('second sync')}\): node 'generate' \(generate, .*{at('gen')}\) "
        r"already receives weights from node 'sync_weights' \(sync_weights, .*test_graph_rules.py:\d+\); "
        r"one sync_weights per generator$")):
        synced_twice(CFG)


OPS_BUILTIN = ("advantage", "dataset", "filter", "generate", "logprobs", "reward", "rollout", "sync_weights",
               "train_step")


def test_op_name_typo_names_the_line_and_the_nearest_op():
    @flow
    def typo(cfg):
        policy = Model("policy", "tiny-arith")
        return ops.genrate(policy, ops.dataset(cfg.dataset))  # typo

    with pytest.raises(GraphError, match=rf"^ops.genrate \(.*{at('typo')}\): no such op; did you mean ops.generate\? "
                       r"ops: ") as info:
        typo(CFG)
    listed = str(info.value).split("ops: ")[-1].split(", ")
    assert listed == sorted(listed)  # every op, sorted; other test modules' user ops (length_penalty) are listed too
    assert set(OPS_BUILTIN) <= set(listed)
    assert not hasattr(ops, "genrate") and not hasattr(ops, "__wrapped__")


def test_cli_prints_each_defect_as_one_line_and_exits_2(tmp_path):
    header = "from areal_flow import Model, flow, ops\n\n@flow\ndef g(cfg):\n    policy = Model('policy', cfg.model)\n"
    bodies = {
        "typo": ("    ops.dataset(cfg.dataset)\n    return ops.train_stepp(policy, None)\n",
                 "typo.py:7): no such op; did you mean ops.train_step?"),
        "ppo": ("    rollout = ops.generate(policy, ops.dataset(cfg.dataset))\n"
                "    adv = ops.advantage(rollout, ops.reward(rollout))\n"
                "    return ops.train_step(policy, adv, algorithm='ppo')\n",
                "node 'train_step' (train_step, {}/ppo.py:8): algorithm 'ppo' needs a critic"),
    }
    for name, (body, message) in bodies.items():
        path = tmp_path / f"{name}.py"
        path.write_text(header + body)
        out = subprocess.run([sys.executable, "-m", "areal_flow.cli", "graph", str(path), "--config",
                              "graphs/arith_grpo.yaml"], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 2, out.stderr
        assert out.stderr.count("\n") == 1 and message.format(tmp_path) in out.stderr, out.stderr
