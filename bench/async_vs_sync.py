"""Benchmark (not a test): the same GRPO job, synchronous (k=0) vs asynchronous (k>=1).

Both runs train the same number of samples (``train.steps * train.batch_size * gen.n_samples``)
from the same warm-started model on this machine, one after the other in one process
tree; it prints both wall times of the RL phase and their ratio. Evaluation is off so only
the generate/train loop is timed.

    python bench/async_vs_sync.py [key=value ...]     # e.g. train.steps=20 async_k=4
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_flow.cli import load_flow  # noqa: E402
from areal_flow.config import load_config  # noqa: E402
from runtime.launch import run_experiment  # noqa: E402


def main(argv: list[str]) -> None:
    async_k = 2
    overrides = []
    for item in argv:
        if item.startswith("async_k="):
            async_k = int(item.split("=", 1)[1])
        else:
            overrides.append(item)
    root = Path(__file__).resolve().parents[1]
    flow = load_flow(root / "graphs" / "arith_grpo.py")
    walls = {}
    for label, k in (("sync", 0), ("async", async_k)):
        cfg = load_config(
            root / "graphs" / "arith_grpo.yaml",
            ["eval.enabled=false", f"async.max_staleness={k}", f"name=bench_{label}", *overrides],
        )
        summary = run_experiment(flow(cfg), cfg, show_progress=False)
        walls[label] = summary["wall_s"]
        print(f"{label:>5} (max_staleness={k}): {summary['wall_s']:7.1f} s for {summary['samples_trained']} samples, "
              f"staleness histogram {summary['staleness_histogram']}", flush=True)
    print(f"async speed-up (sync wall / async wall): {walls['sync'] / walls['async']:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
