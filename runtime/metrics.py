"""Run metrics: TensorBoard scalars, the progress bar, and the end-of-run summary.

Owns how per-step metrics from the trainer become events under ``runs/<name>/`` and text
on the terminal. It must not compute metrics that belong to a worker.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm


class RunLogger:
    """TensorBoard writer + tqdm bar + counters for one run.

    Args:
        out_dir: run folder; event files are written there.
        total_steps: optimizer steps expected (the bar's length).
    """

    def __init__(self, out_dir: Path, total_steps: int, show_progress: bool = True):
        self.out_dir = out_dir
        self.writer = SummaryWriter(log_dir=str(out_dir))
        self.bar = tqdm(total=total_steps, desc="rl", unit="step", disable=not show_progress, dynamic_ncols=True)
        self.start = time.perf_counter()
        self.samples = 0
        self.staleness = Counter()
        self.history: list[dict] = []

    def log_scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step)

    def log_step(self, metrics: dict) -> None:
        """Record one trainer step's metrics (see ``runtime.workers.step_metrics``)."""
        step = metrics["step"]
        self.samples += metrics["samples"]
        self.staleness.update(metrics["staleness"])
        elapsed = time.perf_counter() - self.start
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        scalars["samples_per_s"] = self.samples / max(elapsed, 1e-9)
        for key, value in scalars.items():
            self.writer.add_scalar(key if "/" in key else f"rl/{key}", value, step)
        self.history.append({"step": step, **scalars})
        self.bar.set_postfix(
            reward=f"{metrics['reward']:.2f}",
            acc=f"{metrics['accuracy']:.2f}",
            stale=f"{metrics['staleness_mean']:.2f}",
            sps=f"{scalars['samples_per_s']:.0f}",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.writer.flush()
        self.writer.close()

    def summary(self, **extra) -> dict:
        """The end-of-run record; also written to ``summary.json``."""
        result = {
            "wall_s": round(time.perf_counter() - self.start, 2),
            "samples_trained": self.samples,
            "staleness_histogram": {int(k): v for k, v in sorted(self.staleness.items())},
            **extra,
        }
        (self.out_dir / "summary.json").write_text(json.dumps(result, indent=2))
        return result


def format_summary(summary: dict) -> str:
    """Human-readable end-of-run report."""
    lines = ["", "=== run summary ==="]
    if "accuracy_before" in summary:
        before, after = summary["accuracy_before"], summary["accuracy_after"]
        lines.append(f"held-out greedy accuracy: before RL {before:.1%}  after RL {after:.1%}  ({100 * (after - before):+.1f} points)")
    if "answer_kinds_before" in summary and "answer_kinds_after" in summary:
        before, after = summary["answer_kinds_before"], summary["answer_kinds_after"]
        lines.append("held-out greedy answers by kind, before -> after RL: "
                     + ", ".join(f"{kind} {before[kind]} -> {after[kind]}" for kind in before))
    lines.append(f"RL wall time: {summary['wall_s']:.1f} s   samples trained: {summary['samples_trained']}")
    hist = summary["staleness_histogram"]
    total = sum(hist.values()) or 1
    lines.append("staleness histogram (versions between generation and training):")
    for k, count in hist.items():
        lines.append(f"  {k}: {count:6d}  {'#' * max(1, round(40 * count / total))}")
    for key in ("out_dir", "model_dir", "trajectories"):
        if key in summary:
            lines.append(f"{key}: {summary[key]}")
    return "\n".join(lines)
