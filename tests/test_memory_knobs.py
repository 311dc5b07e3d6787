"""The memory knobs decide the plan, and one executability predicate (compiler.executable)
decides what the compiler may recommend, what a user's allocation may ask and what the
runtime starts (issue 24)."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_flow.cli import load_flow
from areal_flow.config import ConfigError
from areal_flow.config_compile import CompileConfigError
from areal_flow.config_load import load_config
from compiler import AllocationError
from compiler.executable import ExecutableError, NodeFacts, check_executable, check_node, failed_rule
from compiler.program import compile_program
from compiler.strategy import ParallelStrategy
from runtime.context import WorkerContext
from runtime.executors.train_settings import TrainSettings
from runtime.topology import build_topology

REPO = Path(__file__).resolve().parents[1]
GRPO = "graphs/arith_grpo"  # 16 prompts x 8 samples = 128 sequences per step


def _plan(*overrides: str, graph: str = GRPO):
    cfg = load_config(REPO / f"{graph}.yaml", list(overrides))
    return compile_program(load_flow(REPO / f"{graph}.py")(cfg), cfg)


@pytest.mark.parametrize(("value", "on"), [("true", True), ("false", False), ("auto", False)])
def test_activation_checkpointing_true_turns_it_on_false_off_auto_lets_the_compiler_decide(value, on):
    # the tiny model fits without recomputation, so auto leaves it off
    plan = _plan(f"model.activation_checkpointing={value}")
    assert plan.node("train_step").activation_checkpointing is on
    assert plan.node("generate").activation_checkpointing is False


def test_gradient_accumulation_steps_is_the_plans_micro_batches_and_the_trainers():
    plan = _plan("training.gradient_accumulation_steps=4", "model.activation_checkpointing=true")
    node = plan.node("train_step")
    assert node.micro_batches == 4 and node.attrs["gradient_accumulation_steps"] == 4
    ctx = WorkerContext(plan, {m: "/nowhere" for m in plan.models}, Path("/nowhere"))
    settings = TrainSettings.from_node(node, ctx)  # the runtime reads the plan, nothing else
    assert (settings.micro_batches, settings.activation_checkpointing) == (4, True)


def test_gradient_accumulation_steps_dp_is_chosen_to_divide_the_rows():
    # 128 rows, 64 micro-batches per DP rank: only dp <= 2 leaves each rank whole micro-batches
    plan = _plan("training.gradient_accumulation_steps=64", "cluster.n_gpus_per_node=8")
    assert ParallelStrategy.parse(plan.node("train_step").strategy).dp <= 2
    assert plan.node("train_step").micro_batches == 64


@pytest.mark.parametrize(("overrides", "error", "match"), [
    (["training.gradient_accumulation_steps=5"], CompileConfigError,
     r"train.gradient_accumulation_steps=5 does not divide the 128 sequences"),
    (["training.gradient_accumulation_steps=4", "compile.micro_batches=2"], CompileConfigError,
     r"train.gradient_accumulation_steps=4 and compile.micro_batches=2"),
    (["training.gradient_accumulation_steps=4", "train.max_tokens_per_micro_batch=512"], ConfigError,
     r"train.gradient_accumulation_steps=4 with train.max_tokens_per_micro_batch=512"),
    (["training.gradient_accumulation_steps=64", "cluster.n_gpus_per_node=8", "compile.allocation=gen:d1 + train:d4"],
     AllocationError, r"rule 'accumulation-divides-rows': train.gradient_accumulation_steps=64 must divide the 32"),
])
def test_a_memory_knob_that_cannot_work_names_its_key(overrides, error, match):
    with pytest.raises(error, match=match):
        _plan(*overrides)


@pytest.mark.parametrize(("facts", "rule"), [
    (dict(strategy="d1c2", shape=dict(n_layers=4, n_heads=3, n_kv_heads=3, n_experts=0)), "ulysses-heads"),
    (dict(strategy="d2c2e2"), "ep-without-pp-cp"),
    (dict(strategy="d2c2p2"), "cp-without-pp"),
    (dict(strategy="d3", rows=8), "rows-divide-dp"),
    (dict(strategy="d2p4", rows=4), "rows-fill-pp"),
    (dict(strategy="d1p2", token_budget=512), "token-budget-no-pp"),
    (dict(strategy="d1t2p2", critic=True), "critic-parallel"),
    (dict(strategy="d2t2e2", critic=True), "critic-parallel"),
    (dict(strategy="d2", rows=8, accumulation=3), "accumulation-divides-rows"),
    (dict(strategy="d1t2", role="generation"), "engine-parallel"),
    (dict(strategy="d1p2", role="generation", engine="vllm"), "engine-parallel"),
])
def test_each_rule_is_named_in_its_error(facts, rule):
    facts = {"rows": 16, "role": "training", **facts}
    facts["strategy"] = ParallelStrategy.parse(facts["strategy"])
    with pytest.raises(ExecutableError, match=rf"node 'n' strategy .*: rule '{rule}'"):
        check_node(NodeFacts("n", **facts))


@pytest.mark.parametrize("facts", [
    dict(strategy="d2e2"), dict(strategy="d2c2"), dict(strategy="d1t2p2"), dict(strategy="d1t2c2"),
    dict(strategy="d2t2e2"), dict(strategy="d1", critic=True),
    dict(strategy="d2", critic=True), dict(strategy="d1t2", critic=True), dict(strategy="d2t2", critic=True),
    dict(strategy="d1c2", critic=True), dict(strategy="d1p2", critic=True), dict(strategy="d2p2", critic=True),
    dict(strategy="d2e2", critic=True),
    dict(strategy="d4t2", role="generation", engine="vllm"), dict(strategy="d4", role="generation"),
    dict(strategy="d2t2p2c2", role="inference"),  # forward-only: runs on rank 0 of its mesh
])
def test_what_the_runtime_runs_passes(facts):
    facts = {"rows": 16, "role": "training", **facts}
    assert failed_rule(NodeFacts("n", **{**facts, "strategy": ParallelStrategy.parse(facts["strategy"])})) is None


@pytest.mark.parametrize(("graph", "cluster"), [(GRPO, 8), ("graphs/arith_ppo", 4), ("graphs/arith_grpo_moe", 8)])
def test_the_search_never_recommends_what_the_predicate_refuses(graph, cluster):
    plan = _plan(f"cluster.n_gpus_per_node={cluster}", graph=graph)
    check_executable(plan)
    build_topology(plan)
    for alt in plan.alternatives:  # each alternative passes the predicate as a user's allocation
        _plan(f"cluster.n_gpus_per_node={cluster}", f"compile.allocation={alt.allocation}", graph=graph)


def test_a_user_allocation_breaking_a_rule_is_refused_at_compile():
    with pytest.raises(AllocationError, match=r"node 'generate' strategy d1t2: rule 'engine-parallel'"):
        _plan("cluster.n_gpus_per_node=4", "compile.allocation=gen:d1t2 + train:d2")


def test_the_rows_checked_are_the_runs_not_the_time_models():
    # compile.samples_per_prompt=3 changes only the time model's step (16 x 3 = 48 rows, which d3 divides);
    # the run trains 16 x 8 = 128 rows a step, which it does not
    with pytest.raises(AllocationError, match=r"rule 'rows-divide-dp': a step of 128 sequences"):
        _plan("cluster.n_gpus_per_node=8", "compile.samples_per_prompt=3", "compile.allocation=gen:d1 + train:d3")
