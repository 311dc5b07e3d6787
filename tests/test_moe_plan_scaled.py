"""``compile`` of a MoE policy at real scale on 4 x 8 H100 recommends only plans the runtime runs,
and a scaled-down copy of its recommendation runs through ``areal-flow run --plan`` (issue 24).

1. ``areal-flow compile graphs/arith_grpo_moe.py model.path=Qwen3-30B-A3B`` on 4 nodes of 8 H100
   (the graph's hand allocation cleared, so the search chooses): the plan and every alternative
   it lists pass the one executability predicate with Qwen3-30B-A3B's own shape (48 layers, 32
   heads, 4 KV heads, 128 experts).
2. The recommended train_step strategy (``d8e8`` when written), scaled down (the same letters,
   every degree above 1 made 2: ``d8e8`` -> ``d2e2``, ``d1t4p6`` -> ``d1t2p2``), on the tiny Qwen3-MoE preset with
   one generation replica on CPU (gloo): ``compile --plan`` writes the plan, ``run --plan`` runs
   it for 2 steps; every sample trained exactly once, in its step's slot, staleness <= k.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from areal_flow.cli import load_flow, main
from areal_flow.config_load import load_config
from compiler.executable import check_executable
from compiler.models import resolve_model
from compiler.program import compile_program
from compiler.strategy import ParallelStrategy
from runs import records as trained_records

REPO = Path(__file__).resolve().parents[1]
GRAPH = REPO / "graphs" / "arith_grpo_moe.py"
AT_SCALE = ["model.path=Qwen3-30B-A3B", "cluster.n_nodes=4", "cluster.n_gpus_per_node=8", "cluster.gpu=H100",
            "compile.allocation="]


def _compile(overrides: list[str]):
    cfg = load_config(REPO / "graphs" / "arith_grpo_moe.yaml", overrides)
    return compile_program(load_flow(GRAPH)(cfg), cfg)


def _shapes(plan) -> dict[str, dict]:
    spec = resolve_model("Qwen3-30B-A3B")
    shape = dict(n_layers=spec.n_layers, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads, n_experts=spec.n_experts)
    return {node.model: shape for node in plan.nodes if node.model}


def scaled_down(strategy: str) -> str:
    """``strategy`` with the same letters, each degree above 1 made 2 (``d1t4p6`` -> ``d1t2p2``)."""
    s = ParallelStrategy.parse(strategy)
    return ParallelStrategy(**{d: min(getattr(s, d), 2) for d in ("dp", "tp", "pp", "cp", "ep")}).short()


def test_scaling_down_keeps_the_letters():
    assert scaled_down("d1t4p6") == "d1t2p2"
    assert scaled_down("d8e8") == "d2e2"
    assert scaled_down("d232e4") == "d2e2"


@pytest.fixture(scope="module")
def at_scale():
    return _compile(AT_SCALE)


def test_compile_at_scale_recommends_an_executable_plan(at_scale):
    assert resolve_model("Qwen3-30B-A3B").n_experts == 128
    check_executable(at_scale, _shapes(at_scale))


@pytest.mark.slow
def test_every_alternative_compile_lists_at_scale_is_executable(at_scale):
    assert len(at_scale.alternatives) >= 2
    for alternative in at_scale.alternatives:
        plan = _compile([*AT_SCALE[:-1], f"compile.allocation={alternative.allocation}"])
        check_executable(plan, _shapes(plan))


def _cli(*args) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(a) for a in args])
    assert code == 0, err.getvalue()


@pytest.mark.slow
def test_the_recommended_strategy_scaled_down_runs(at_scale, tmp_path, warm_cache):
    k = 1
    strategy = scaled_down(at_scale.node("train_step").strategy)
    world = ParallelStrategy.parse(strategy).world_size
    plan_path = tmp_path / "plan.json"
    _cli("compile", GRAPH, "model.path=tiny-moe", "train.steps=2", "train.batch_size=2", "gen.n_samples=4",
         "warm_start.steps=10", "eval.enabled=false", f"async.max_staleness={k}", f"out_dir={tmp_path}",
         f"cluster.n_gpus_per_node={world + 1}", f"compile.allocation=train:{strategy} + gen:d1",
         "--plan", "-o", plan_path)
    plan = json.loads(plan_path.read_text())
    assert {n["name"]: n["strategy"] for n in plan["nodes"]}["train_step"] == strategy
    _cli("run", "--plan", plan_path)
    records = trained_records(tmp_path / "arith_grpo_moe")
    # 2 steps x 2 groups x 4 samples, each trained once, in its step's slot, at most k versions old
    assert len(records) == len({(r["group_id"], r["sample_id"]) for r in records}) == 2 * 2 * 4
    assert all(r["group_id"] // 2 == r["step"] for r in records)
    assert all(r["staleness"] <= k for r in records)
