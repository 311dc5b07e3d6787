"""Keyword arguments an op forwards (estimator knobs, user-op attributes, dataset keys) are
checked while the graph is traced: a typo is one line naming the node, graph file:line,
the argument, a did-you-mean and what is accepted, from every command, before a run writes."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from areal_flow import Model, flow, ops
from areal_flow.graph import GraphError
from areal_flow.ops.registry import OPS, register_op

ROOT = Path(__file__).resolve().parents[1]
CFG = NS(dataset={"name": "arithmetic"})
HERE = Path(__file__).name


def _advantage_flow(**kwargs):
    @flow
    def graph(cfg):
        policy = Model("policy", "tiny-arith")
        rollout = ops.generate(policy, ops.dataset(cfg.dataset))
        return ops.advantage(rollout, ops.reward(rollout), **kwargs)

    return graph


def test_misspelt_advantage_argument_names_node_line_near_name_and_estimator_knobs():
    with pytest.raises(GraphError) as err:
        _advantage_flow(estimatr="rloo")(CFG)
    message = str(err.value)
    assert f"node 'advantage' (advantage, tests/{HERE}:" in message
    assert "unknown argument 'estimatr'; did you mean 'estimator'?" in message
    # no estimator named yet (the train_step's algorithm decides): the knobs of any built-in estimator, by hand
    # from advantages.py: gae (gamma, lam), grpo / lite_ppo (eps, std_unbiased), reinforce_pp (gamma, eps),
    # multi_turn (gamma, mode, baseline)
    assert message.endswith("an estimator takes: baseline, eps, gamma, lam, mode, std_unbiased")


def test_knob_of_another_estimator_is_rejected_and_own_knobs_pass():
    with pytest.raises(GraphError, match=r"unknown argument 'lam'; estimator 'rloo' takes: no extra arguments"):
        _advantage_flow(estimator="rloo", lam=0.9)(CFG)
    with pytest.raises(GraphError, match=r"unknown argument 'lamb'; did you mean 'lam'\? estimator 'gae' takes: gamma, lam"):
        _advantage_flow(estimator="gae", critic=Model("critic", "tiny-arith"), lamb=0.9)(CFG)
    graph = _advantage_flow(estimator="gae", critic=Model("critic", "tiny-arith"), gamma=0.99, lam=0.95)(CFG)
    assert graph.nodes["advantage"].attrs["lam"] == 0.95


def test_misspelt_reward_fn_names_the_nearest_known_one():
    def graph_with(fn):
        @flow
        def graph(cfg):
            rollout = ops.generate(Model("policy", "tiny-arith"), ops.dataset(cfg.dataset))
            return ops.reward(rollout, fn=fn)

        return graph

    with pytest.raises(GraphError, match=r"node 'reward' .*: unknown reward fn 'mathh'; did you mean 'math'\? "
                                         r"known: arithmetic, gsm8k, math, longtail, reasoning_gym or a callable$"):
        graph_with("mathh")(CFG)
    with pytest.raises(GraphError, match=r"unknown reward fn 'zzz'; known: arithmetic, "):  # nothing near: no guess
        graph_with("zzz")(CFG)


def test_dataset_keys_and_task_are_checked_at_graph_build():
    @flow
    def graph(cfg):
        policy = Model("policy", "tiny-arith")
        return ops.generate(policy, ops.dataset(cfg.dataset))

    with pytest.raises(GraphError, match=r"node 'dataset' .*unknown argument 'max_digit'; did you mean 'max_digits'\? "
                                         r"dataset config takes: name, path, max_digits, ops, prompt_style"):
        graph(NS(dataset={"name": "arithmetic", "max_digit": 2}))
    with pytest.raises(GraphError, match=r"node 'dataset' .*dataset.name='gsm8': unknown task; known: arithmetic, gsm8k"):
        graph(NS(dataset={"name": "gsm8"}))


def test_user_op_attribute_typo_is_caught_unless_the_function_takes_kwargs():
    @register_op("test_args_penalty", inputs={"rollouts": "rollouts", "rewards": "rewards"}, outputs={"rewards": "rewards"})
    def penalty(rollouts, rewards, coef=0.01):
        return rewards

    @register_op("test_args_open", inputs={"rewards": "rewards"}, outputs={"rewards": "rewards"})
    def open_ended(rewards, **attrs):
        return rewards

    def graph_with(**attrs):
        @flow
        def graph(cfg):
            policy = Model("policy", "tiny-arith")
            rollout = ops.generate(policy, ops.dataset(cfg.dataset))
            return open_ended(penalty(rollout, ops.reward(rollout), **attrs), anything=1)

        return graph

    try:
        with pytest.raises(GraphError, match=r"node 'test_args_penalty' .*unknown argument 'coeff'; did you mean 'coef'\? "
                                             r"op 'test_args_penalty' \(function penalty\) takes: coef$"):
            graph_with(coeff=0.1)(CFG)
        assert graph_with(coef=0.1)(CFG).nodes["test_args_penalty"].attrs == {"coef": 0.1}
    finally:
        OPS.pop("test_args_penalty")
        OPS.pop("test_args_open")


@pytest.mark.parametrize("op, typo, meant", [
    ("dataset", "nmae", "name"), ("generate", "n_sample", "n_samples"), ("rollout", "max_turn", "max_turns"),
    ("reward", "overlng", "overlong"), ("filter", "kep", "keep"), ("logprobs", "temprature", "temperature"),
    ("train_step", "max_stalness", "max_staleness"), ("sync_weights", "too", "to"),
])
def test_every_builtin_op_names_a_misspelt_keyword_with_its_line(op, typo, meant):
    with pytest.raises(GraphError) as err:
        getattr(ops, op)(**{typo: 1})  # checked before the op runs (here even outside a flow)
    line = err.traceback[0].lineno + 1  # pytest's line numbers count from 0
    assert str(err.value).startswith(f"ops.{op} (tests/{HERE}:{line}): unknown argument '{typo}'; "
                                     f"did you mean '{meant}'? ops.{op} takes: ")


@pytest.mark.parametrize("command", ["graph", "compile", "run"])
def test_every_command_exits_2_with_one_line_before_writing(tmp_path, command):
    graph = tmp_path / "typo.py"
    graph.write_text("from areal_flow import Model, flow, ops\n\n\n@flow\ndef typo(cfg):\n"
                     "    policy = Model('policy', 'tiny-arith')\n"
                     "    rollout = ops.generate(policy, ops.dataset(cfg.dataset))\n"
                     "    adv = ops.advantage(rollout, ops.reward(rollout), estimatr='rloo')\n"
                     "    return ops.train_step(policy, adv)\n")
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "areal_flow.cli", command, str(graph)], cwd=tmp_path,
                         capture_output=True, text=True, env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "typo.py:8): unknown argument 'estimatr'; did you mean 'estimator'?" in out.stderr
    assert not (tmp_path / "runs").exists()  # run.out_dir (relative to the working folder): nothing written
