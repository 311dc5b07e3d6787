"""Tracing a @flow into the graph IR, and every validation error naming its culprit."""

from types import SimpleNamespace as NS

import pytest

from areal_flow import Model, flow, ops
from areal_flow.graph import DATA, WEIGHTS, Edge, Graph, GraphError, ModelRef, Node
from areal_flow.ops.registry import op_specs

CFG = NS(dataset={"name": "arithmetic"})


@flow
def grpo(cfg):
    policy = Model("policy", "tiny-arith")
    prompts = ops.dataset(cfg.dataset)
    rollout = ops.generate(policy, prompts, n_samples=4, max_new_tokens=6)
    reward = ops.reward(rollout, fn="arithmetic")
    adv = ops.advantage(rollout, reward, estimator="grpo")
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=2)
    ops.sync_weights(policy, to=rollout)
    return stats


def test_trace_builds_nodes_edges_and_staleness():
    g = grpo(CFG)
    assert list(g.nodes) == ["dataset", "generate", "reward", "advantage", "train_step", "sync_weights"]
    edges = {(e.src, e.src_port, e.dst, e.dst_port, e.kind, e.max_staleness) for e in g.edges}
    assert edges == {
        ("dataset", "prompts", "generate", "prompts", DATA, None),
        ("generate", "rollouts", "reward", "rollouts", DATA, None),
        ("generate", "rollouts", "advantage", "rollouts", DATA, None),
        ("reward", "rewards", "advantage", "rewards", DATA, None),
        ("advantage", "advantages", "train_step", "advantages", DATA, 2),
        ("train_step", "weights", "sync_weights", "weights", WEIGHTS, None),
        ("sync_weights", "weights", "generate", "weights", WEIGHTS, None),
    }
    assert g.models == {"policy": ModelRef("policy", "tiny-arith", True)}
    assert g.outputs == [("train_step", "stats")]
    # The weight edges close a cycle generate -> ... -> train_step -> sync -> generate, which is legal.
    assert g.topological_order().index("generate") < g.topological_order().index("train_step")
    # Every node remembers the line of this file that created it.
    assert all(n.source.startswith("tests/test_graph_dsl.py:") or "test_graph_dsl.py:" in n.source for n in g)


def test_describe_lists_edges_kinds_and_staleness():
    text = grpo(CFG).describe()
    assert "advantage.advantages -> train_step.advantages  [data]  max_staleness=2" in text
    assert "sync_weights.weights -> generate.weights  [weights]" in text


def _manual_graph() -> Graph:
    g = Graph("manual", op_specs())
    g.add_model(ModelRef("policy", "tiny-arith"))
    g.add_node(Node("data", "dataset"))
    g.add_node(Node("gen", "generate", model="policy"))
    g.add_edge(Edge("data", "prompts", "gen", "prompts"))
    return g


def test_unknown_op_names_node():
    g = _manual_graph()
    g.add_node(Node("mystery", "distill", source="x.py:7"))
    with pytest.raises(GraphError, match=r"node 'mystery' \(distill, x.py:7\): unknown op 'distill'"):
        g.validate()


def test_missing_producer_names_node_and_port():
    @flow
    def broken(cfg):
        policy = Model("policy", "tiny-arith")
        prompts = ops.dataset(cfg.dataset)
        ops.generate(policy, prompts)
        return None

    g = _manual_graph()
    g.add_node(Node("score", "reward"))  # its 'rollouts' input is never connected
    with pytest.raises(GraphError, match=r"node 'score' \(reward.*input port 'rollouts' \(rollouts\) has no producer"):
        g.validate()
    broken(CFG)  # a graph without training is still valid


def test_port_type_mismatch_names_both_ends():
    @flow
    def wrong(cfg):
        policy = Model("policy", "tiny-arith")
        rollout = ops.generate(policy, ops.dataset(cfg.dataset))
        reward = ops.reward(rollout)
        return ops.train_step(policy, reward)  # rewards where advantages are expected

    with pytest.raises(GraphError, match=r"input port 'advantages' expects advantages, but 'reward.rewards' produces rewards"):
        wrong(CFG)


def test_two_train_steps_on_one_model():
    @flow
    def twice(cfg):
        policy = Model("policy", "tiny-arith")
        rollout = ops.generate(policy, ops.dataset(cfg.dataset))
        adv = ops.advantage(rollout, ops.reward(rollout))
        ops.train_step(policy, adv)
        return ops.train_step(policy, adv)

    with pytest.raises(GraphError, match=r"node 'train_step_1'.*model 'policy' is already updated by node 'train_step'"):
        twice(CFG)


def test_data_cycle_without_staleness_is_a_deadlock():
    g = _manual_graph()
    g.add_node(Node("r", "reward"))
    g.add_node(Node("a", "advantage", attrs={"estimator": "grpo"}))
    g.add_node(Node("t", "train_step", model="policy", attrs={"max_staleness": 0}))
    g.add_edge(Edge("gen", "rollouts", "r", "rollouts"))
    g.add_edge(Edge("gen", "rollouts", "a", "rollouts"))
    g.add_edge(Edge("r", "rewards", "a", "rewards"))
    g.add_edge(Edge("a", "advantages", "t", "advantages", max_staleness=0))
    g.add_edge(Edge("t", "weights", "gen", "weights", kind=DATA))  # a weights port but a data edge
    with pytest.raises(GraphError, match=r"cycle .*gen.* has no weights edge and no staleness >= 1"):
        g.validate()
    # The same loop with staleness >= 1 on one of its edges is legal.
    g.edges[-2] = Edge("a", "advantages", "t", "advantages", max_staleness=1)
    g.nx.remove_edges_from(list(g.nx.edges))
    for e in g.edges:
        g.nx.add_edge(e.src, e.dst, edge=e)
    g.validate()


def test_sync_weights_takes_a_weights_dtype_and_names_a_bad_one():
    def graph(dtype):
        @flow
        def g(cfg):
            policy = Model("policy", "tiny-arith")
            rollout = ops.generate(policy, ops.dataset(cfg.dataset))
            stats = ops.train_step(policy, ops.advantage(rollout, ops.reward(rollout)))
            ops.sync_weights(policy, to=rollout, weights_dtype=dtype)
            return stats
        return g(CFG)

    assert graph("bf16").nodes["sync_weights"].attrs == {"weights_dtype": "bf16"}
    assert graph("ENGINE").nodes["sync_weights"].attrs == {"weights_dtype": "ENGINE"}  # the dtype the engine announces
    with pytest.raises(GraphError, match=r"sync_weights.*test_graph_dsl.py:\d+.*weights_dtype='int8': expected one of "
                                         r"float32.* or engine"):
        graph("int8")


def test_sync_weights_target_must_be_generate_of_same_model():
    @flow
    def bad_target(cfg):
        policy = Model("policy", "tiny-arith")
        rollout = ops.generate(policy, ops.dataset(cfg.dataset))
        reward = ops.reward(rollout)
        adv = ops.advantage(rollout, reward)
        stats = ops.train_step(policy, adv)
        ops.sync_weights(policy, to=reward)
        return stats

    with pytest.raises(GraphError, match=r"sync_weights.*target node 'reward' \(reward.*must be a generate or rollout node of model 'policy'"):
        bad_target(CFG)

    @flow
    def other_model(cfg):
        policy, actor = Model("policy", "tiny-arith"), Model("actor", "tiny-arith")
        rollout = ops.generate(actor, ops.dataset(cfg.dataset))
        stats = ops.train_step(policy, ops.advantage(rollout, ops.reward(rollout)))
        ops.sync_weights(policy, to=rollout)
        return stats

    with pytest.raises(GraphError, match=r"must be a generate or rollout node of model 'policy' \(it is a generate node of model 'actor'\)"):
        other_model(CFG)

    @flow
    def to_dataset(cfg):
        policy = Model("policy", "tiny-arith")
        prompts = ops.dataset(cfg.dataset)
        rollout = ops.generate(policy, prompts)
        stats = ops.train_step(policy, ops.advantage(rollout, ops.reward(rollout)))
        ops.sync_weights(policy, to=prompts)
        return stats

    with pytest.raises(GraphError, match=r"must be a generate or rollout node of model 'policy' \(it is a dataset node with no model\)$"):
        to_dataset(CFG)


def test_sync_weights_before_train_step_is_an_error():
    @flow
    def early(cfg):
        policy = Model("policy", "tiny-arith")
        rollout = ops.generate(policy, ops.dataset(cfg.dataset))
        ops.sync_weights(policy, to=rollout)

    with pytest.raises(GraphError, match=r"no train_step updates model 'policy'"):
        early(CFG)


def test_non_handle_input_and_bad_arguments_name_the_line():
    @flow
    def raw(cfg):
        policy = Model("policy", "tiny-arith")
        return ops.generate(policy, ["1+1="])

    with pytest.raises(GraphError, match=r"node 'generate' \(generate, .*test_graph_dsl.py:\d+\): input 'prompts' must be"):
        raw(CFG)

    @flow
    def negative(cfg):
        policy = Model("policy", "tiny-arith")
        rollout = ops.generate(policy, ops.dataset(cfg.dataset))
        return ops.train_step(policy, ops.advantage(rollout, ops.reward(rollout)), max_staleness=-1)

    with pytest.raises(GraphError, match=r"max_staleness must be an int >= 0, got -1"):
        negative(CFG)


def test_ops_outside_a_flow_raise():
    with pytest.raises(RuntimeError, match="only be called while tracing"):
        ops.dataset({"name": "arithmetic"})


def test_unknown_algorithm_and_estimator_are_caught_while_tracing():
    @flow
    def bad_algorithm(cfg):
        policy = Model("policy", "tiny-arith")
        rollout = ops.generate(policy, ops.dataset(cfg.dataset))
        return ops.train_step(policy, ops.advantage(rollout, ops.reward(rollout)), algorithm="grpoo")

    with pytest.raises(GraphError, match=r"node 'train_step' .*unknown algorithm 'grpoo' \(did you mean 'grpo'\?\); registered: .*grpo"):
        bad_algorithm(CFG)

    @flow
    def bad_estimator(cfg):
        policy = Model("policy", "tiny-arith")
        rollout = ops.generate(policy, ops.dataset(cfg.dataset))
        return ops.advantage(rollout, ops.reward(rollout), estimator="gea")

    with pytest.raises(GraphError, match=r"node 'advantage' .*unknown advantage estimator 'gea'; known: .*gae"):
        bad_estimator(CFG)

