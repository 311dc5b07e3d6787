"""The search: agreement with brute-force enumeration on small clusters, the local CPU
plan, manual allocations and pins, the allocation grammar's errors, and infeasibility."""

import itertools
import json
import re

import pytest

from areal_flow.graph import Edge, Graph, ModelRef, Node
from compiler import AllocationError, ClusterConfig, CompileConfig, InfeasiblePlanError, compile_plan
from compiler.allocation import parse
from areal_flow.config_compile import CompileConfigError
from compiler.cost import CostModel
from compiler.executable import failed_rule
from compiler.hardware import device_spec
from compiler.hosting import hosting_problem, workload_hosting
from compiler.mesh import MeshError, MeshSpec, aligned_sizes, pack
from compiler.search import _Search
from compiler.step import evaluate
from compiler.strategy import ParallelStrategy, StrategyError
from compiler.workload import GENERATION, build_workload


def grpo_graph(spec: str, critic: bool = False) -> Graph:
    """dataset -> generate -> reward -> advantage -> train_step (+ weights back to generate);
    with ``critic``, the advantage reads a critic model that has its own train_step (PPO).
    Generation uses vLLM, the engine that runs tensor parallelism (compiler.executable)."""
    g = Graph("ppo" if critic else "grpo", {})
    g.add_model(ModelRef("policy", spec))
    gen = {"n_samples": 4, "max_new_tokens": 512, "engine": "vllm"}
    nodes = [Node("dataset", "dataset"), Node("generate", "generate", "policy", gen),
             Node("reward", "reward"),
             Node("advantage", "advantage", "critic" if critic else None, {"model_role": "critic"} if critic else {}),
             Node("train_step", "train_step", "policy", {"max_staleness": 1}), Node("sync_weights", "sync_weights", "policy")]
    edges = [("dataset", "generate"), ("generate", "reward"), ("reward", "advantage"), ("advantage", "train_step")]
    if critic:
        g.add_model(ModelRef("critic", spec))
        nodes.append(Node("critic_step", "train_step", "critic"))
        edges.append(("advantage", "critic_step"))
    for node in nodes:
        g.add_node(node)
    for src, dst in edges:
        g.add_edge(Edge(src, "out", dst, "in", max_staleness=1 if dst == "train_step" else None))
    g.add_edge(Edge("train_step", "weights", "sync_weights", "weights", "weights"))
    g.add_edge(Edge("sync_weights", "weights", "generate", "weights", "weights"))
    return g


def _aligned_meshes(n_nodes, per_node):
    """Every aligned mesh at every position (independent of compiler.mesh.pack)."""
    meshes = [MeshSpec(m, 1, start, size) for m in range(n_nodes)
              for size in (1, 2, 4, 8, 16) if size < per_node for start in range(0, per_node, size)]
    meshes += [MeshSpec(first, k, 0, per_node) for k in range(1, n_nodes + 1) for first in range(n_nodes - k + 1)]
    return meshes


def _all_strategies(task, size, per_node, n_sequences, model):
    """The search space, enumerated independently of compiler.cost: dp at most the step's
    sequences; generation may replicate KV heads and uses neither CP nor EP; on the training
    side CP is a power of two with tp * cp within a machine, and EP (MoE only) divides the
    experts and dp * cp and stays within a machine; and the runtime can run it (the one
    predicate, compiler.executable)."""
    found = []
    train_side = task.role != GENERATION
    for dp, tp, pp, cp, ep in itertools.product(range(1, size + 1), repeat=5):
        if dp * tp * pp * cp != size or dp > n_sequences or (dp * cp) % ep:
            continue
        if cp > 1 and (not train_side or cp & (cp - 1) or tp * cp > per_node):
            continue
        if ep > 1 and (not train_side or ep > per_node):
            continue
        s = ParallelStrategy(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
        try:
            s.validate_for(n_layers=task.model.n_layers, n_heads=task.model.n_heads,
                           n_kv_heads=task.model.n_kv_heads, n_experts=task.model.n_experts,
                           gpus_per_node=per_node, replicate_kv=task.role == GENERATION)
        except StrategyError:
            continue
        if failed_rule(model.facts(task, s)) is None:
            found.append(s)
    return found


def brute_force(graph, cluster, cfg, batch_groups):
    """Best (step time, allocation) over every pair of disjoint aligned meshes (with a critic,
    also every triple: generation, the policy's side, the critic's side: its train_step and
    the advantage node that reads it) and every combination of per-node strategies that
    compiler.hosting runs (a critic on several ranks of the policy trainer's mesh shares its
    strategy), each costed by compiler.step.evaluate; ties break on the serial time
    G + T + S, then the allocation string."""
    model = CostModel(build_workload(graph, cfg, batch_groups), device_spec(cluster.gpu), cluster, cfg)
    gen = [t for t in model.workload.tasks if t.role == GENERATION]
    train = [t for t in model.workload.tasks if t.role != GENERATION]
    meshes = _aligned_meshes(cluster.n_nodes, cluster.n_gpus_per_node)
    layouts = {"disaggregated": [], "colocated": [([gen + train], [m]) for m in meshes]}
    for a, b in itertools.product(meshes, meshes):
        if not set(a.devices()) & set(b.devices()):
            layouts["disaggregated"].append(([gen, train], [a, b]))
    critic_side = [t for t in train if t.model_name == "critic"]
    if critic_side:
        policy_side = [t for t in train if t not in critic_side]
        for a, b, c in itertools.product(meshes, meshes, meshes):
            if len(set(a.devices()) | set(b.devices()) | set(c.devices())) == a.size + b.size + c.size:
                layouts["disaggregated"].append(([gen, policy_side, critic_side], [a, b, c]))
    found = {}
    for kind, options in layouts.items():
        found[kind] = []
        if kind == "colocated" and model.device.one_engine_per_device and found["disaggregated"]:
            continue
        for groups_tasks, group_meshes in options:
            per_task = [[(t, s) for s in _all_strategies(t, m.size, cluster.n_gpus_per_node,
                                                          model.workload.n_sequences, model)]
                        for tasks, m in zip(groups_tasks, group_meshes) for t in tasks]
            for combo in itertools.product(*per_task):
                it = iter(combo)
                groups = [[next(it) for _ in tasks] for tasks in groups_tasks]
                label = {t.node: i for i, tasks in enumerate(groups_tasks) for t in tasks}
                if hosting_problem(workload_hosting(model.workload, label, dict(combo))) is not None:
                    continue
                cand = evaluate(model, groups, group_meshes)
                if cand.fits:
                    serial = cand.generation_s + cand.training_s + cand.sync_s
                    found[kind].append((cand.step_time_s, serial, cand.allocation))
    best = min(found["disaggregated"] + found["colocated"])
    return best[0], best[2]


CASES = [  # (model, cluster, compile config, B = prompt groups per step, critic)
    ("Qwen2.5-1.5B", ClusterConfig(1, 8, "H100"), CompileConfig(), 32, False),
    ("Qwen2.5-7B", ClusterConfig(1, 8, "A100-80G"), CompileConfig(mode="sync"), 16, False),
    ("Qwen2.5-7B", ClusterConfig(2, 4, "L40S"), CompileConfig(), 16, False),
    ("Qwen2.5-1.5B", ClusterConfig(1, 4, "H100"), CompileConfig(), 16, True),
    ("Qwen2.5-7B", ClusterConfig(1, 4, "H100"), CompileConfig(), 8, True),  # the critic fits no single device
    ("SmolLM2-135M", ClusterConfig(1, 4, "cpu"), CompileConfig(max_prompt_len=32, max_new_tokens=32), 4, False),
]


@pytest.mark.parametrize("spec,cluster,cfg,b,critic", CASES)
def test_search_matches_brute_force(spec, cluster, cfg, b, critic):
    graph = grpo_graph(spec, critic)
    plan = compile_plan(graph, cluster, cfg, batch_groups=b)
    step, allocation = brute_force(graph, cluster, cfg, b)
    assert plan.allocation == allocation
    assert plan.step_time_s == pytest.approx(step, rel=1e-12)


def test_search_matches_brute_force_on_16_gpus():
    graph, cluster = grpo_graph("Llama-3-8B"), ClusterConfig(2, 8, "H100")
    cfg = CompileConfig()
    plan = compile_plan(graph, cluster, cfg, batch_groups=32)
    assert (plan.step_time_s, plan.allocation) == pytest.approx(brute_force(graph, cluster, cfg, 32))


SMALL_MOE = dict(  # a Qwen3-MoE-shaped config small enough for brute force: 16 experts, top-4
    model_type="qwen3_moe", hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
    head_dim=64, intermediate_size=2816, moe_intermediate_size=512, num_experts=16, num_experts_per_tok=4,
    vocab_size=32000, tie_word_embeddings=False,
)


def test_search_with_ep_matches_brute_force(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL_MOE))
    graph, cluster = grpo_graph(str(path)), ClusterConfig(1, 8, "H100")
    cfg = CompileConfig(max_new_tokens=2048, fsdp_overlap=0.0)
    plan = compile_plan(graph, cluster, cfg, batch_groups=16)
    assert (plan.step_time_s, plan.allocation) == pytest.approx(brute_force(graph, cluster, cfg, 16))


def test_search_with_cp_matches_brute_force_on_a_long_context():
    # 2 responses of up to 64k tokens: dp <= 2, so spreading training wider needs TP, PP or CP
    graph, cluster = grpo_graph("Qwen2.5-1.5B"), ClusterConfig(1, 8, "H100")
    cfg = CompileConfig(samples_per_prompt=2, max_new_tokens=65536)
    plan = compile_plan(graph, cluster, cfg, batch_groups=1)
    assert (plan.step_time_s, plan.allocation) == pytest.approx(brute_force(graph, cluster, cfg, 1))


def _every_layout(graph, cluster, cfg, batch_groups):
    """(step, serial, allocation) of the best layout over every aligned size pair, every
    aligned size triple (generation, policy's side, critic's side) when the graph has a
    critic, and every colocated size, with no bound or dominance pruning
    (compiler.search._Search.layout on each)."""
    model = CostModel(build_workload(graph, cfg, batch_groups), device_spec(cluster.gpu), cluster, cfg)
    s = _Search(model, {})
    sizes = aligned_sizes(cluster.n_nodes, cluster.n_gpus_per_node)
    found = []
    for a, b in itertools.product(sizes, sizes):
        try:
            meshes = pack([a, b], cluster.n_nodes, cluster.n_gpus_per_node)
        except MeshError:
            continue
        result = s.layout([s.gen, s.train], meshes)
        if result is not None:
            found.append((result[0], result[1], s.label(result[2])))
    critic_side = [t for t in s.train if t.model_name == "critic"]
    for a, b, c in itertools.product(sizes, sizes, sizes) if critic_side else ():
        try:
            meshes = pack([a, b, c], cluster.n_nodes, cluster.n_gpus_per_node)
        except MeshError:
            continue
        result = s.layout([s.gen, [t for t in s.train if t not in critic_side], critic_side], meshes)
        if result is not None:
            found.append((result[0], result[1], s.label(result[2])))
    for size in sizes:
        result = s.layout([s.gen + s.train], pack([size], cluster.n_nodes, cluster.n_gpus_per_node))
        if result is not None:
            found.append((result[0], result[1], s.label(result[2])))
    return min(found)


@pytest.mark.parametrize("spec,mode,n_nodes,critic", [
    ("Qwen2.5-7B", "async", 8, False), ("Qwen2.5-7B", "sync", 8, False), ("Qwen3-30B-A3B", "async", 8, False),
    ("Qwen3-30B-A3B", "async", 32, False), ("Qwen2.5-72B", "sync", 32, False), ("Qwen3-30B-A3B", "sync", 32, False),
    ("Qwen2.5-7B", "async", 4, True), ("Qwen2.5-7B", "sync", 8, True)])
def test_pruned_search_equals_every_layout(spec, mode, n_nodes, critic):
    graph, cluster = grpo_graph(spec, critic), ClusterConfig(n_nodes, 8, "H100")
    cfg = CompileConfig(mode=mode)
    plan = compile_plan(graph, cluster, cfg, batch_groups=256)
    step, _, allocation = _every_layout(graph, cluster, cfg, 256)
    assert (plan.step_time_s, plan.allocation) == (step, allocation)


def test_local_cpu_plan_is_disaggregated_one_device_each():
    plan = compile_plan(grpo_graph("tiny-arith"), ClusterConfig(1, 2, "cpu"),
                        CompileConfig(max_prompt_len=16, max_new_tokens=8), batch_groups=8)
    gen, train = plan.node("generate"), plan.node("train_step")
    assert (gen.mesh, train.mesh) == (MeshSpec(0, 1, 0, 1), MeshSpec(0, 1, 1, 1))
    assert gen.strategy == train.strategy == "d1"
    assert plan.allocation == "gen:d1 + train:d1" and not plan.colocated
    assert plan.node("reward").placed_with == "generate" and plan.node("dataset").placed_with == "generate"
    one = compile_plan(grpo_graph("tiny-arith"), ClusterConfig(), CompileConfig(max_new_tokens=8), batch_groups=64)
    assert one.allocation == "gen:d1 | train:d1"  # one device: both engines share it


def test_plans_are_deterministic():
    args = (grpo_graph("Qwen2.5-7B"), ClusterConfig(2, 8, "H100"), CompileConfig())
    first, second = compile_plan(*args, batch_groups=64), compile_plan(*args, batch_groups=64)
    assert first == second and first.id == second.id
    other = compile_plan(*args, batch_groups=32)
    assert other.id != first.id


def test_manual_allocation_and_pins():
    graph, cluster = grpo_graph("Qwen2.5-7B"), ClusterConfig(2, 8, "H100")
    plan = compile_plan(graph, cluster, CompileConfig(allocation="gen:d4t2 + train:d2t2p2"), batch_groups=64)
    assert plan.allocation == "gen:d4t2 + train:d2t2p2"
    assert plan.node("generate").mesh == MeshSpec(0, 1, 0, 8)
    assert plan.node("train_step").mesh == MeshSpec(1, 1, 0, 8)
    assert plan.alternatives[0].allocation == plan.allocation
    pinned = compile_plan(graph, cluster, CompileConfig(pins={"gen": "d2t2"}), batch_groups=64)
    assert pinned.node("generate").strategy == "d2t2"
    assert pinned.allocation.startswith("gen:d2t2 ")
    with pytest.raises(CompileConfigError, match="compile.pins.gen"):
        compile_plan(graph, cluster, CompileConfig(pins={"gen": "t8"}), batch_groups=64)  # 8 does not divide 4 KV heads


@pytest.mark.parametrize("text,position,reason", [
    ("gen d4 + train:d4", 4, "expected ':'"),
    ("gen:d4 + train:x4", 15, "d/t/p/c/e"),
    ("gen:d4t2t2 + train:d2", 8, "given twice"),
    ("gen:d4 * train:d4", 7, "expected '+'"),
    ("gen:d4 + ", 9, "expected a node name"),
    ("gen:d0", 4, ">= 1"),
])
def test_grammar_errors_point_at_the_character(text, position, reason):
    with pytest.raises(AllocationError, match=re.escape(reason)) as info:
        parse(text)
    assert info.value.position == position
    quoted, caret = str(info.value).splitlines()[1:3]
    assert quoted == "  " + text and caret == "  " + " " * position + "^"


def test_allocation_binding_errors():
    graph, cluster = grpo_graph("Qwen2.5-7B"), ClusterConfig(2, 8, "H100")
    cases = [
        ("gen:d8 + critic:d8", 9, "not a device node"),
        ("gen:d8", 6, "not placed: train_step"),
        ("gen:d8 | train:d4", 15, "shares a mesh of 8"),
        ("gen:d1t8 + train:d8", 4, "KV heads"),
        ("gen:d16 + train:d8", 0, "do not fit"),
    ]
    for text, position, reason in cases:
        with pytest.raises(AllocationError, match=reason) as info:
            compile_plan(graph, cluster, CompileConfig(allocation=text), batch_groups=64)
        assert info.value.position == position, text


def test_infeasible_error_names_every_node_floor_and_knob():
    with pytest.raises(InfeasiblePlanError) as info:
        compile_plan(grpo_graph("Qwen2.5-72B"), ClusterConfig(1, 8, "H100"), CompileConfig(), batch_groups=64)
    by_node = {s.node: s for s in info.value.shortfalls}
    assert set(by_node) == {"generate", "train_step"}
    # generation: 2 x 72.7e9 B of weights over tp=8 = 18.2e9 B (16.9 GiB) + one KV slot: fits
    assert by_node["generate"].fits
    # training: 16 B x 72,706,203,648 params / 8 devices = 145.4e9 B = 135.4 GiB > 0.9 x 79.65 GiB
    floor = by_node["train_step"]
    states = sum(floor.breakdown[k] for k in ("weights", "gradients", "optimizer"))
    assert states >= 16 * 72_706_203_648 / 8
    assert not floor.fits and floor.capacity == pytest.approx(0.9 * 81_559 * 2**20)
    assert "more devices" in floor.knob
    message = str(info.value)
    assert "train_step" in message and "GiB" in message and "generate" in message
    with pytest.raises(InfeasiblePlanError, match="does not fit"):
        compile_plan(grpo_graph("Qwen2.5-7B"), ClusterConfig(1, 8, "H100"),
                     CompileConfig(allocation="gen:d4 + train:d1"), batch_groups=64)
