"""The discrete-event simulation of a plan: a toy plan whose timeline is drawn by hand, the
command line, and AReaL's Table 1 async/sync ratios (Fu et al. 2025) within 15 %."""

import dataclasses
import json

import pytest

from areal_flow.cli import main
from compiler import ClusterConfig, CompileConfig, compile_plan
from areal_flow.config_compile import LengthDistConfig
from compiler.simulate import SimulationError, simulate
from test_compiler_outputs import grpo_7b
from test_compiler_search import grpo_graph


def toy_plan():
    """One replica with 2 slots, one prompt group of 2 responses of exactly 2 tokens per step;
    a device so fast that a decode step costs only the 1 s per-step overhead (prefill ~0);
    train_step 3 s; weight sync 1 s."""
    cfg = CompileConfig(samples_per_prompt=2, max_prompt_len=1, max_new_tokens=2,
                        length_dist=LengthDistConfig(kind="fixed", mean=1.0), decode_step_overhead_s=1.0)
    graph = grpo_7b()
    graph.models["policy"] = dataclasses.replace(graph.models["policy"], spec="tiny-arith")
    plan = compile_plan(graph, ClusterConfig(1, 2, "cpu"), cfg, batch_groups=1)
    assert plan.allocation == "gen:d1 + train:d1" and plan.node("generate").concurrent == 2
    device = {**plan.device, "peak_flops": 1e30, "hbm_bandwidth": 1e30}
    nodes = tuple(dataclasses.replace(n, times={"compute": 3.0}) if n.name == "train_step" else n for n in plan.nodes)
    return dataclasses.replace(plan, device=device, nodes=nodes, sync_s=1.0)


def test_toy_plan_timeline_drawn_by_hand():
    plan = toy_plan()
    # k = 0 (sync): generate the 2 responses together (2 steps of 1 s), train 3 s, sync 1 s, repeat:
    #   replica0 |gen 0-2|              |gen 6-8|              |gen 12-14| ...
    #   trainer          |train 2-5|sync|        |train 8-11|sync|
    #   weights loaded at 6, 12, 18, ...: 6 s per step = G + T + S = 2 + 3 + 1
    sync = simulate(plan, k=0, steps=6)
    assert sync.step_time_s == pytest.approx(6.0)
    assert sync.busy["generate"] == pytest.approx(2 / 6)
    assert sync.busy["train_step"] == pytest.approx(3 / 6) and sync.busy["sync_weights"] == pytest.approx(1 / 6)
    # k = 1: groups 0 and 1 admitted at t=0; 4 responses, 2 slots: group 0 decodes 0-2, group 1 2-4.
    #   replica0 |g0 0-2|g1 2-4|  paused 5-6 |g2 6-8|  paused 9-10 |g3 10-12| ...
    #   trainer          |train0 2-5|sync 5-6|train1 6-9|sync 9-10|train2 10-13|sync 13-14|
    #   loads at 6, 10, 14, ...: 4 s per step = max(G, T) + S = max(2, 3) + 1; the trainer bounds it.
    #   Per 4 s in steady state: generate 2 s (50 %), 2 of 2 slots live while it does (occupancy 50 %),
    #   train 3 s (75 %), sync 1 s (25 %), trainer idle 0.
    full = simulate(plan, k=1, steps=6)
    assert full.step_time_s == pytest.approx(4.0)
    assert full.busy["generate"] == pytest.approx(0.5) and full.occupancy == pytest.approx(0.5)
    assert full.busy["train_step"] == pytest.approx(0.75) and full.busy["sync_weights"] == pytest.approx(0.25)
    assert full.bubbles["trainer"] == pytest.approx(0.0, abs=1e-9)
    spans = [(s.node, s.worker, s.start, s.end) for s in full.spans if s.start < 10]
    assert ("train_step", "trainer", 6.0, 9.0) in spans and ("sync_weights", "trainer", 5.0, 6.0) in spans


def test_cli_prints_sync_and_plan_k(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(toy_plan().to_json())
    assert main(["simulate", str(path), "--steps", "6", "--trace", str(tmp_path / "spans.json")]) == 0
    out = capsys.readouterr().out
    assert "async (k=1) / sync (k=0) = 1.50x" in out  # 6 s / 4 s
    spans = json.loads((tmp_path / "spans.json").read_text())
    assert {s["node"] for s in spans["k=1"]} == {"generate", "train_step", "sync_weights"}
    data = json.loads(path.read_text())
    del data["workload"]
    path.write_text(json.dumps(data))
    assert main(["simulate", str(path)]) == 2
    assert "compile it again" in capsys.readouterr().err
    with pytest.raises(SimulationError, match="steps"):
        simulate(toy_plan(), steps=1)


# AReaL (Fu et al. 2025, arXiv 2505.24298), Table 1: hours to train, synchronous AReaL vs AReaL.
#   1.5B (DeepSeek-R1-Distill-Qwen-1.5B): 41.0 h vs 14.8 h = 2.77x; 7B (R1-Distill-Qwen-7B): 57.7 h vs 25.4 h = 2.27x.
# Assumptions (docs/SIMULATE.md): Qwen2.5-1.5B / -7B shapes (the distilled models' bases); 512 prompts x 16
# responses per step, prompts <= 1024 tokens, responses <= 27,648 tokens (AReaL's 1.5B run configuration);
# 1.5B on 16 x 8 H800, 7B on 24 x 8 (ASSUMED for 7B); AReaL's 3:1 generation:training split
# (d96 + d32, d144 + d48); staleness k = 4 (AReaL's default max_head_offpolicyness); the default long-tail
# lengths (lognormal, mean 0.35 of the budget, sigma 1) and 2 ms per decode step; sync = the same plan, k = 0.
# For 7B, 516 prompts: the trainer's 48 DP ranks need a step's sequences to divide by 48 (compiler.executable).
AREAL = [("Qwen2.5-1.5B", 16, "gen:d96 + train:d32", 512, 41.0 / 14.8),
         ("Qwen2.5-7B", 24, "gen:d144 + train:d48", 516, 57.7 / 25.4)]


@pytest.mark.slow
@pytest.mark.parametrize("spec,nodes,allocation,prompts,published", AREAL)
def test_async_over_sync_matches_areal_table_1(spec, nodes, allocation, prompts, published):
    cfg = CompileConfig(samples_per_prompt=16, max_prompt_len=1024, max_new_tokens=27648, allocation=allocation)
    plan = compile_plan(grpo_graph(spec), ClusterConfig(nodes, 8, "H800"), cfg, batch_groups=prompts)
    ratio = simulate(plan, k=0).step_time_s / simulate(plan, k=4).step_time_s
    assert ratio == pytest.approx(published, rel=0.15)
