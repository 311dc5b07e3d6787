"""Noise of a multi-turn run's held-out evaluation: its two models re-evaluated with other sampling seeds.

A run of a graph with ``ops.rollout`` reports the held-out success rate of the model it
started from (the warm start) and of the model it ended with, each from one episode per
held-out row sampled at ``eval.temperature`` with sampling seed 0 (``runtime.run_setup``).
This script loads the run's plan, rebuilds the same held-out rows and the same version-0
folder (``runtime.model_source.prepare_models``: the cached warm start), and plays the rows
again with both models under each ``--seeds`` sampling seed (``runtime.evaluate.evaluate_episodes``,
the run's own evaluation). The spread between seeds is the evaluation's noise.

Run: ``.venv/bin/python bench/episode_eval_noise.py runs/arith_python_tool --seeds 1 2``.
Prints one JSON line per (model, seed): success rate, mean turns, mean return, env means.
This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compiler.plan import Plan, decode_value  # noqa: E402
from runtime.evaluate import evaluate_episodes  # noqa: E402
from runtime.executors.rollout import episode_context  # noqa: E402
from runtime.model_source import load_pretrained, prepare_models  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="a finished run folder (plan.json, model/)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="sampling seeds of the re-evaluations")
    args = parser.parse_args()
    from areal_flow.tasks.catalog import build_task

    plan = Plan.from_json((args.run_dir / "plan.json").read_text(), source=str(args.run_dir / "plan.json"))
    source = next(n for n in plan.nodes if n.grain == "source")
    rollout = next(n for n in plan.nodes if n.grain == "stream")
    attrs = decode_value(rollout.attrs)
    task = build_task(source.attrs, plan.run["seed"])
    rows = task.test_set(plan.run["eval"]["n_test"])
    temperature = float(plan.run["eval"].get("temperature", 0.0))
    before = prepare_models(plan, task, names=[rollout.model])[rollout.model]
    for label, folder in (("before", before), ("after", args.run_dir / "model")):
        model, tokenizer = load_pretrained(folder)
        for seed in args.seeds:
            start = time.perf_counter()
            stats = evaluate_episodes(model, tokenizer, attrs, rows, temperature=temperature, seed=seed,
                                      max_context=episode_context(attrs, folder))
            print(json.dumps({"run": str(args.run_dir), "model": label, "seed": seed, "n": len(rows),
                              **{k: round(v, 4) for k, v in stats.items()},
                              "wall_s": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
