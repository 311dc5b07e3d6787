"""Benchmark: seconds for ``compile_plan`` to search 1,024- and 4,096-GPU clusters (budget: 2 s).

Run: ``.venv/bin/python bench/compile_search.py [--mode sync] [--critic]`` (``--critic``: PPO, a critic of
the policy's shape with its own train_step, so split layouts are searched too; prints one line per case and the load
average; each case is compiled from a fresh cost model, i.e. with no memoized costs; the
cases run interleaved, three rounds, and each reports its best round).
"""

from __future__ import annotations

import argparse
import os
import time

from areal_flow.graph import Edge, Graph, ModelRef, Node
from compiler import ClusterConfig, CompileConfig, compile_plan

BUDGET_S = 2.0


def grpo(spec: str, critic: bool = False) -> Graph:
    """GRPO; with ``critic``, PPO: the advantage reads a critic (the policy's shape) trained by ``critic_step``."""
    g = Graph("ppo" if critic else "grpo", {})
    g.add_model(ModelRef("policy", spec))
    nodes = [Node("dataset", "dataset"),
             Node("generate", "generate", "policy", {"n_samples": 16, "max_new_tokens": 4096, "engine": "vllm"}),
             Node("reward", "reward"),
             Node("advantage", "advantage", "critic" if critic else None, {"model_role": "critic"} if critic else {}),
             Node("train_step", "train_step", "policy")]
    edges = [("dataset", "generate"), ("generate", "reward"), ("reward", "advantage"), ("advantage", "train_step")]
    if critic:
        g.add_model(ModelRef("critic", spec))
        nodes.append(Node("critic_step", "train_step", "critic"))
        edges.append(("advantage", "critic_step"))
    for node in nodes:
        g.add_node(node)
    for src, dst in edges:
        g.add_edge(Edge(src, "out", dst, "in", max_staleness=1 if dst == "train_step" else None))
    g.add_edge(Edge("train_step", "weights", "generate", "weights", "weights"))
    return g


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("async", "sync"), default="async", help="compile.mode (default async)")
    parser.add_argument("--critic", action="store_true", help="PPO with a critic (split layouts searched too)")
    args = parser.parse_args()
    cfg = CompileConfig(max_prompt_len=1024, mode=args.mode)
    specs = ("Qwen2.5-1.5B", "Qwen2.5-7B", "Llama-3-8B") if args.critic else (  # rank 0's fp32 critic copy must fit
        "Qwen2.5-7B", "Qwen2.5-72B", "Llama-3-70B", "Qwen3-30B-A3B")
    cases = [(spec, n) for n in (128, 512) for spec in specs]
    times: dict = {case: [] for case in cases}
    plans = {}
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for _ in range(3):  # interleaved rounds, so a burst of load hits every case alike
        for spec, n in cases:
            start = time.perf_counter()
            plans[spec, n] = compile_plan(grpo(spec, args.critic), ClusterConfig(n_nodes=n, n_gpus_per_node=8, gpu="H100"), cfg,
                                          batch_groups=512)
            times[spec, n].append(time.perf_counter() - start)
    for spec, n in cases:
        plan = plans[spec, n]
        print(f"{spec:<14} {8 * n:>5} x H100: {min(times[spec, n]):.3f} s (best of 3)  -> {plan.allocation}, "
              f"step {plan.step_time_s:.1f} s")
    worst = max(min(t) for t in times.values())
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"slowest case {worst:.3f} s; budget {BUDGET_S:.1f} s: {'OK' if worst < BUDGET_S else 'OVER'}")
    return 0 if worst < BUDGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
