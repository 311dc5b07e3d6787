"""Offline reward analysis of a run's trajectory dumps.

Usage::

    python -m areal_flow.debug.reward_analysis --trajectory runs/<name>/trajectories --plot

Owns: reading trajectory JSONL (one JSON object per line with ``sample_id``,
``group_id``, ``prompt_text``, ``output_text``, ``output_ids``, ``reward``, ``versions``,
``behavior_logprobs``, ``finish_reason``, ``meta``, plus ``step``, the trainer step that
consumed the sample, and ``staleness``, trainer version minus the sample's start
version), and summarizing it: reward over trainer steps, per-prompt pass rates, response
length vs reward, staleness vs reward, finish reason vs reward; a printed text summary and
an optional PNG. Must not: write trajectories or touch a running job.

A sample *passes* when ``reward >= pass_threshold`` (default 0.5, i.e. a 0/1 rule reward
of 1). Prompts are keyed by ``prompt_text`` (the same prompt may recur in several groups
across epochs), or by ``group_id`` when the text is empty.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

_REQUIRED = ("sample_id", "group_id", "reward", "step", "staleness")


@dataclass
class GroupStats:
    """Count, mean and spread of the rewards of the samples sharing one key."""

    n: int
    mean: float
    std: float
    """Population standard deviation (divides by ``n``)."""
    pass_rate: float
    """Fraction of samples with ``reward >= pass_threshold``."""


@dataclass
class RewardReport:
    """What ``analyze`` computes; every dict is ordered by its key."""

    n_samples: int
    pass_threshold: float
    by_step: dict[int, GroupStats]
    by_prompt: dict[str, GroupStats]
    by_staleness: dict[int, GroupStats]
    by_finish_reason: dict[str, GroupStats]
    by_length_bin: dict[tuple[int, int], GroupStats]
    """Response length bins ``[lo, hi)`` in tokens (equal width), from ``output_ids``."""
    length_reward_corr: float
    """Pearson correlation of response length (tokens) and reward; NaN if either is constant."""
    prompt_pass_histogram: dict[str, int] = field(default_factory=dict)
    """Prompts whose samples all fail / are mixed / all pass (GRPO learns only from mixed)."""


def load_trajectories(path: str | Path) -> list[dict]:
    """Trajectory records from a ``*.jsonl`` file or every ``*.jsonl`` in a folder (sorted).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: no trajectories there (no ``*.jsonl`` files, or only empty ones), or a
            bad line, named ``<file>:<line>``: not a JSON object, a required field
            (``sample_id``, ``group_id``, ``reward``, ``step``, ``staleness``) missing, or
            ``reward`` not a finite number.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--trajectory {path}: no such file or folder")
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"--trajectory {path}: folder has no *.jsonl trajectory files")
    records: list[dict] = []
    for file in files:
        with file.open(encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, start=1):
                if line.strip():
                    records.append(_check_record(line, f"{file}:{line_no}"))
    if not records:
        raise ValueError(f"--trajectory {path}: no trajectories in {len(files)} file(s) (all empty)")
    return records


def analyze(records: list[dict], pass_threshold: float = 0.5, n_length_bins: int = 8) -> RewardReport:
    """Group the rewards of ``records`` by step, prompt, staleness, finish reason and length.

    Raises:
        ValueError: ``records`` is empty or ``n_length_bins < 1``.
    """
    if not records:
        raise ValueError("analyze: no trajectories")
    if n_length_bins < 1:
        raise ValueError(f"analyze: n_length_bins must be >= 1, got {n_length_bins}")
    rewards = [float(r["reward"]) for r in records]
    lengths = [_length(r) for r in records]
    by_prompt = _group(records, rewards, _prompt_key, pass_threshold)
    histogram = Counter(
        "all_fail" if s.pass_rate == 0 else "all_pass" if s.pass_rate == 1 else "mixed"
        for s in by_prompt.values())
    bins = _length_bins(lengths, n_length_bins)
    return RewardReport(
        n_samples=len(records),
        pass_threshold=pass_threshold,
        by_step=_group(records, rewards, lambda r: int(r["step"]), pass_threshold),
        by_prompt=by_prompt,
        by_staleness=_group(records, rewards, lambda r: int(r["staleness"]), pass_threshold),
        by_finish_reason=_group(records, rewards, lambda r: str(r.get("finish_reason")), pass_threshold),
        by_length_bin=_group(list(zip(records, lengths)), rewards, lambda rl: _bin_of(rl[1], bins),
                             pass_threshold),
        length_reward_corr=_pearson(lengths, rewards),
        prompt_pass_histogram={k: histogram.get(k, 0) for k in ("all_fail", "mixed", "all_pass")},
    )


def format_summary(report: RewardReport, top_k: int = 5) -> str:
    """Human-readable summary: overall, per step, staleness, finish reason, length, prompts."""
    lines = [f"{report.n_samples} trajectories, {len(report.by_prompt)} prompts, "
             f"pass = reward >= {report.pass_threshold:g}"]
    sections = [("step", report.by_step), ("staleness", report.by_staleness),
                ("finish_reason", report.by_finish_reason),
                ("response length [tokens]", {f"[{lo}, {hi})": s for (lo, hi), s in report.by_length_bin.items()})]
    for title, table in sections:
        lines.append(f"\nreward by {title}:")
        lines.append(f"  {'key':>16} {'n':>6} {'mean':>8} {'std':>8} {'pass':>6}")
        lines += [f"  {str(k):>16} {s.n:>6} {s.mean:>8.3f} {s.std:>8.3f} {s.pass_rate:>6.2f}"
                  for k, s in table.items()]
    lines.append(f"\nlength-reward Pearson correlation: {report.length_reward_corr:.3f}")
    hist = report.prompt_pass_histogram
    lines.append(f"prompts all fail: {hist['all_fail']}, mixed: {hist['mixed']}, all pass: {hist['all_pass']}")
    ranked = sorted(report.by_prompt.items(), key=lambda kv: (kv[1].pass_rate, kv[0]))
    for title, items in (("hardest", ranked[:top_k]), ("easiest", ranked[::-1][:top_k])):
        lines.append(f"\n{title} prompts (pass rate, n, prompt):")
        lines += [f"  {s.pass_rate:.2f} {s.n:>4}  {_shorten(k)}" for k, s in items]
    return "\n".join(lines)


def plot(report: RewardReport, records: list[dict], out_path: str | Path) -> Path:
    """Write a 2x2 PNG: reward over steps, per-prompt pass rates, length vs reward,
    staleness vs reward. Uses matplotlib's object API (no global pyplot state).

    Returns:
        the PNG path.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 9), dpi=100)
    ax_step, ax_prompt, ax_len, ax_stale = fig.subplots(2, 2).flat
    steps = list(report.by_step)
    means = [s.mean for s in report.by_step.values()]
    lo, hi = min(float(r["reward"]) for r in records), max(float(r["reward"]) for r in records)
    centers, smooth, low, high = smoothed_band(records, window=max(1, len(steps) // 20), lo=lo, hi=hi)
    ax_step.plot(steps, means, lw=0.8, alpha=0.5, label="mean reward")
    ax_step.plot(centers, smooth, color="C0", lw=2, label="smoothed mean")
    ax_step.fill_between(centers, low, high, alpha=0.25, label=f"95% CI (clipped to [{lo:g}, {hi:g}])")
    pass_rates = [s.pass_rate for s in report.by_step.values()]
    if any(abs(p - m) > 1e-9 for p, m in zip(pass_rates, means)):  # for 0/1 rewards they are one line
        ax_step.plot(steps, pass_rates, marker=".", ls="--", label="pass rate")
    ax_step.set(title="reward by trainer step", xlabel="step", ylabel="reward")
    ax_step.legend()
    ax_prompt.hist([s.pass_rate for s in report.by_prompt.values()], bins=11, range=(0, 1))
    ax_prompt.set(title=f"per-prompt pass rate ({len(report.by_prompt)} prompts)",
                  xlabel="pass rate", ylabel="prompts")
    ax_len.scatter([_length(r) for r in records], [float(r["reward"]) for r in records], s=8, alpha=0.4)
    centers = [(lo + hi) / 2 for lo, hi in report.by_length_bin]
    ax_len.plot(centers, [s.mean for s in report.by_length_bin.values()], color="C1", marker="o", label="bin mean")
    ax_len.set(title=f"response length vs reward (r = {report.length_reward_corr:.2f})",
               xlabel="response length [tokens]", ylabel="reward")
    ax_len.legend()
    matched = staleness_within_steps(records)
    ax_stale.bar([str(k) for k in matched], [v for v, _ in matched.values()])
    for i, (value, n) in enumerate(matched.values()):
        ax_stale.annotate(f"n={n}", (i, value), ha="center", va="bottom", fontsize=8)
    ax_stale.axhline(0, color="gray", lw=0.8)
    ax_stale.set(title="staleness vs reward, within the same steps", xlabel="staleness [policy versions]",
                 ylabel="reward - its step's mean")
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png")
    return out_path


def smoothed_band(records: list[dict], window: int, lo: float, hi: float, z: float = 1.96):
    """Mean reward over a centred window of ``2 * window + 1`` steps, with a normal-approximation
    confidence band ``mean ± z * sd / sqrt(n)`` (n = samples pooled in the window, sd their
    population standard deviation) clipped to the reward range ``[lo, hi]``.

    Returns:
        ``(steps, means, lows, highs)``, one entry per distinct step, ascending.
    """
    by_step: dict[int, list[float]] = {}
    for r in records:
        by_step.setdefault(int(r["step"]), []).append(float(r["reward"]))
    steps = sorted(by_step)
    means, lows, highs = [], [], []
    for i in range(len(steps)):
        pooled = [v for s in steps[max(0, i - window): i + window + 1] for v in by_step[s]]
        mean = sum(pooled) / len(pooled)
        half = z * math.sqrt(sum((v - mean) ** 2 for v in pooled) / len(pooled)) / math.sqrt(len(pooled))
        means.append(mean)
        lows.append(max(lo, mean - half))
        highs.append(min(hi, mean + half))
    return steps, means, lows, highs


def staleness_within_steps(records: list[dict]) -> dict[int, tuple[float, int]]:
    """Staleness against reward with time held fixed: each sample's reward minus the mean
    reward of its own step, averaged per staleness value (so a staleness that only occurs
    early, when rewards are low, does not look harmful). Steps with a single staleness value
    contribute 0 to it and are left out.

    Returns:
        ``{staleness: (mean reward - step mean, samples)}``, ascending staleness.
    """
    by_step: dict[int, list[dict]] = {}
    for r in records:
        by_step.setdefault(int(r["step"]), []).append(r)
    sums: dict[int, list[float]] = {}
    for rows in by_step.values():
        if len({int(r["staleness"]) for r in rows}) < 2:
            continue
        step_mean = sum(float(r["reward"]) for r in rows) / len(rows)
        for r in rows:
            sums.setdefault(int(r["staleness"]), []).append(float(r["reward"]) - step_mean)
    return {k: (sum(v) / len(v), len(v)) for k, v in sorted(sums.items())}


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints the summary, writes the PNG with ``--plot``. Exit code 0/2."""
    parser = argparse.ArgumentParser(prog="python -m areal_flow.debug.reward_analysis",
                                     description="Summarize rewards in trajectory JSONL dumps.")
    parser.add_argument("--trajectory", required=True, help="a *.jsonl file or a folder of them")
    parser.add_argument("--plot", action="store_true", help="also write a PNG")
    parser.add_argument("--out", default=None,
                        help="PNG path (default: reward_analysis.png in the folder / beside the file)")
    parser.add_argument("--pass-threshold", type=float, default=0.5, help="pass = reward >= this")
    parser.add_argument("--top-k", type=int, default=5, help="hardest/easiest prompts listed")
    args = parser.parse_args(argv)
    try:
        records = load_trajectories(args.trajectory)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = analyze(records, pass_threshold=args.pass_threshold)
    print(format_summary(report, top_k=args.top_k))
    if args.plot:
        path = Path(args.trajectory)
        out = Path(args.out) if args.out else (path if path.is_dir() else path.parent) / "reward_analysis.png"
        print(f"\nplot written to {plot(report, records, out)}")
    return 0


# ----------------------------------------------------------------------------- helpers


def _check_record(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in _REQUIRED if k not in record]
    if missing:
        raise ValueError(f"{where}: trajectory record lacks field(s) {missing}")
    reward = record["reward"]
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"{where}: reward must be a finite number, got {reward!r}")
    return record


def _length(record: dict) -> int:
    """Response length in tokens (``output_ids``); whitespace words of ``output_text`` if absent."""
    ids = record.get("output_ids")
    return len(ids) if isinstance(ids, list) else len(str(record.get("output_text", "")).split())


def _prompt_key(record: dict) -> str:
    return record.get("prompt_text") or f"group {record['group_id']}"


def _group(items: list, rewards: list[float], key, pass_threshold: float) -> dict:
    buckets: dict = defaultdict(list)
    for item, reward in zip(items, rewards):
        buckets[key(item)].append(reward)
    return {k: _stats(v, pass_threshold) for k, v in sorted(buckets.items())}


def _stats(values: list[float], pass_threshold: float) -> GroupStats:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / n)
    return GroupStats(n=n, mean=mean, std=std, pass_rate=sum(v >= pass_threshold for v in values) / n)


def _length_bins(lengths: list[int], n_bins: int) -> list[tuple[int, int]]:
    lo, hi = min(lengths), max(lengths) + 1
    width = max(1, math.ceil((hi - lo) / n_bins))
    return [(lo + i * width, lo + (i + 1) * width) for i in range(math.ceil((hi - lo) / width))]


def _bin_of(length: int, bins: list[tuple[int, int]]) -> tuple[int, int]:
    return next(b for b in bins if b[0] <= length < b[1])


def _pearson(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return float("nan")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / math.sqrt(sxx * syy)


def _shorten(text: str, width: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


if __name__ == "__main__":
    sys.exit(main())
