"""Benchmark (not a test): the cost of the run's timeline, ``logging.trace`` on vs off.

Runs the same small GRPO job (arith_grpo, evaluation off) with the trace off and on,
alternating ``--repeats`` times, and prints each RL-phase wall time (seconds, from
``summary.json``), the medians and their ratio (on / off), the spans the traced run wrote,
and the cost of one span measured alone (microseconds), which bounds the trace's share of
the run when the wall times are too noisy to show it.

    python bench/trace_overhead.py [--repeats 2] [key=value ...]   # e.g. train.steps=40
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_flow.cli import load_flow  # noqa: E402
from areal_flow.config_load import load_config  # noqa: E402
from areal_flow.cli.run import run_experiment  # noqa: E402
from runtime.trace import TraceRecorder  # noqa: E402


def span_cost_us(run_dir: Path, n: int = 20000) -> float:
    """Microseconds per recorded span (``complete`` with three args, flushes included)."""
    recorder = TraceRecorder(run_dir, "bench")
    started = time.perf_counter()
    for i in range(n):
        recorder.complete("generate", "engine", i, i + 1, step=i, version=0, finished=[])
    recorder.close()
    return (time.perf_counter() - started) / n * 1e6

SMALL = ["train.steps=40", "train.batch_size=4", "gen.n_samples=8", "warm_start.steps=10", "eval.enabled=false"]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting, alternating off/on")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides after the small job's")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    flow = load_flow(root / "graphs" / "arith_grpo.py")
    walls: dict[str, list[float]] = {"off": [], "on": []}
    spans = 0
    for repeat in range(args.repeats):
        for label in ("off", "on"):
            cfg = load_config(root / "graphs" / "arith_grpo.yaml",
                              [*SMALL, f"logging.trace={label == 'on'}", f"name=bench_trace_{label}", *args.overrides])
            summary = run_experiment(flow(cfg), cfg, show_progress=False)
            walls[label].append(summary["wall_s"])
            if label == "on":
                events = json.loads(Path(summary["trace"]).read_text())["traceEvents"]
                spans = sum(e["ph"] == "X" for e in events)
            print(f"run {repeat + 1}, trace {label:>3}: {summary['wall_s']:7.2f} s", flush=True)
    off, on = statistics.median(walls["off"]), statistics.median(walls["on"])
    cost = span_cost_us(Path(tempfile.mkdtemp()))
    print(f"median wall: trace off {off:.2f} s, trace on {on:.2f} s; ratio on/off {on / off:.3f} "
          f"({spans} spans in the traced run's trace.json)")
    print(f"one span: {cost:.2f} us; {spans} spans: {spans * cost / 1e3:.1f} ms = {spans * cost / 1e4 / on:.3f} % "
          "of the traced run")


if __name__ == "__main__":
    main(sys.argv[1:])
