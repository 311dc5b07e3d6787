"""Run metrics: TensorBoard scalars, the progress bar, and the end-of-run summary.

Owns how per-step metrics from the trainer become events under ``runs/<name>/`` and text
on the terminal. It must not compute metrics that belong to a worker.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from runtime.run_dir import STEPS_FILE


EXTRA_TAGS = {"eval/accuracy": "eval/accuracy", "lr": "train/lr", "train/lr": "train/lr",
              "weights/sync_s": "weights/sync_s", "weights/bytes": "weights/bytes", "reward/failures": "reward/failures"}
"""Optional keys of a step's metrics dict -> their tag (logged only in the steps that carry them)."""

WALL_FILE = "rl_wall.json"
"""``{"step", "wall_s"}``: the RL wall time of the run so far (seconds, every attempt up to its
last logged step), rewritten after each step; a resumed or restarted run adds it to its own."""


def _tagged(metrics: dict) -> dict[str, float]:
    """A step's numeric metrics by TensorBoard tag: ``rl/<key>`` unless the key holds a ``/``,
    the tag of :data:`EXTRA_TAGS` for its keys."""
    return {EXTRA_TAGS.get(k, k if "/" in k else f"rl/{k}"): v for k, v in metrics.items()
            if isinstance(v, (int, float)) and k != "step"}


PURGE_LINE = "Detected out of order event.step likely caused by a TensorFlow restart"
"""How TensorBoard's event reader starts the warning it logs when it hides the events of an
earlier attempt after a later attempt's start (``event_accumulator._Purge``)."""


class _NoPurgeLines(logging.Filter):
    """Drops TensorBoard's purge warning (:data:`PURGE_LINE`) from its ``tensorboard`` logger.

    Harmless for our read: the purge is what we want (a resumed attempt's
    ``SummaryWriter(purge_step=...)`` hides the events of steps it trains again; TensorBoard's
    own display drops them the same way), not a sign of damage, yet it reads as an alarm on the
    console of every resume after the first."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(PURGE_LINE)


def read_events(folder: Path):
    """Every event file of ``folder`` read as TensorBoard shows it (an ``EventAccumulator``,
    reloaded, every scalar event kept), without its purge warning (:class:`_NoPurgeLines`,
    filtered for this read only)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    quiet, tb_logger = _NoPurgeLines(), logging.getLogger("tensorboard")  # the reader's logger (tb_logging)
    tb_logger.addFilter(quiet)
    try:
        events.Reload()
    finally:
        tb_logger.removeFilter(quiet)
    return events


def _earlier_wall_s(out_dir: Path) -> float:
    """The RL seconds of a run folder's earlier attempts (:data:`WALL_FILE`; 0 without one)."""
    try:
        return float(json.loads((out_dir / WALL_FILE).read_text())["wall_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


class WandbWriter:
    """The ``add_scalar``/``flush``/``close`` face of a Weights & Biases run, so ``RunLogger``
    writes to it as to TensorBoard's ``SummaryWriter``.

    Args:
        out_dir: run folder; W&B files go to ``<out_dir>/wandb`` (offline: nothing leaves
            the machine; ``wandb sync`` uploads later).
        project, mode: ``logging.wandb_project``, ``logging.wandb_mode`` (online, offline, disabled).
        config: the run's config as a dict (shown in the W&B run).

    Raises:
        ModuleNotFoundError: wandb is not installed, with the pip command (one line).
    """

    def __init__(self, out_dir: Path, project: str, mode: str = "offline", name: str | None = None,
                 config: dict | None = None):
        try:
            import wandb
        except ImportError:
            raise ModuleNotFoundError("logging.wandb=true needs the wandb package: pip install 'areal-flow[wandb]'") from None
        self.run = wandb.init(project=project, name=name, mode=mode, dir=str(out_dir), config=config or {},
                              settings=wandb.Settings(silent=True))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: value}, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class RunLogger:
    """TensorBoard writer (and optionally W&B) + tqdm bar + counters for one run.

    Args:
        out_dir: run folder; event files are written there.
        total_steps: optimizer steps expected (the bar's length).
        wandb: a ``LoggingConfig`` with ``wandb=True`` adds a ``WandbWriter`` beside
            TensorBoard (every scalar goes to both); None or ``wandb=False``: TensorBoard only.
        run_name, config: the W&B run's name and config.
        first_step: the step a resumed run continues from: TensorBoard hides the events of
            steps ``>= first_step`` an earlier attempt wrote (``SummaryWriter(purge_step=...)``),
            the bar starts there, and the RL wall time continues the earlier attempts'
            (:data:`WALL_FILE`); samples/s stays this attempt's (``earlier_samples``, the
            samples kept from earlier attempts, do not count). The scalars of steps
            ``< first_step`` that no event file holds are logged from the trainer's
            ``runtime.run_dir.STEPS_FILE`` (:meth:`_log_lost_steps`).

    Raises:
        ModuleNotFoundError: W&B asked for but not installed (see ``WandbWriter``).
    """

    def __init__(self, out_dir: Path, total_steps: int, show_progress: bool = True, wandb=None,
                 run_name: str | None = None, config: dict | None = None, first_step: int | None = None):
        self.out_dir = out_dir
        self.writers = [SummaryWriter(log_dir=str(out_dir), purge_step=first_step)]
        if wandb is not None and wandb.wandb:
            self.writers.append(WandbWriter(out_dir, wandb.wandb_project, wandb.wandb_mode, run_name, config))
        self.writer = self.writers[0]
        self.bar = tqdm(total=total_steps, initial=first_step or 0, desc="rl", unit="step",
                        disable=not show_progress, dynamic_ncols=True)
        self.start = time.perf_counter()
        self.earlier_s = _earlier_wall_s(out_dir) if first_step is not None else 0.0
        self.samples = self.earlier_samples = 0
        self.replayed = 0  # rows a replay node trained again (not in samples)
        self.staleness = Counter()
        self.last_step: int | None = None  # the last step logged (Ctrl-C says how many were done)
        if first_step:
            self._log_lost_steps(first_step)

    def _log_lost_steps(self, first_step: int) -> None:
        """Log to TensorBoard each scalar of a step ``< first_step`` that the trainer recorded
        (``runtime.run_dir.STEPS_FILE``) and no event file of the run holds: an earlier driver was
        killed before its writer flushed it, or before the trainer's report of the step reached
        it. (W&B is not completed: its offline run of the killed driver is its own.)"""
        path = self.out_dir / STEPS_FILE
        if not path.is_file():
            return
        events = read_events(self.out_dir)
        held = {(tag, e.step) for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
        for line in path.read_text().splitlines():
            metrics = json.loads(line)
            step = metrics["step"]
            for tag, value in _tagged(metrics).items():
                if step < first_step and (tag, step) not in held:
                    self.writer.add_scalar(tag, value, step)

    def note(self, text: str) -> None:
        """Show ``text`` on the bar until the next step's figures replace it (e.g. start-up)."""
        self.bar.set_postfix_str(text)

    def log_scalar(self, tag: str, value: float, step: int) -> None:
        """One scalar at any step (e.g. ``eval/accuracy`` of a mid-run evaluation), to every writer."""
        for writer in self.writers:
            writer.add_scalar(tag, value, step)

    def log_step(self, metrics: dict) -> None:
        """Record one trainer step's metrics (see ``runtime.observe.step_metrics``).

        Numeric keys go to ``rl/<key>`` unless they hold a ``/``; the optional keys of
        ``EXTRA_TAGS`` (``eval/accuracy``, ``lr`` or ``train/lr``, ``weights/sync_s``,
        ``weights/bytes`` (bytes), ``reward/failures`` (count)) are logged under their tag
        in the steps that carry them.
        """
        step = metrics["step"]
        self.last_step = step
        self.samples += metrics["samples"]
        self.replayed += metrics.get("samples_replayed", 0)
        self.staleness.update(metrics["staleness"])
        elapsed = time.perf_counter() - self.start
        samples_per_s = (self.samples - self.earlier_samples) / max(elapsed, 1e-9)
        (self.out_dir / WALL_FILE).write_text(json.dumps({"step": step, "wall_s": round(self.earlier_s + elapsed, 3)}))
        for tag, value in _tagged({**metrics, "samples_per_s": samples_per_s}).items():
            self.log_scalar(tag, value, step)
        acc = {"acc": f"{metrics['accuracy']:.2f}"} if "accuracy" in metrics else {}  # absent: nothing judged
        self.bar.set_postfix(reward=f"{metrics['reward']:.2f}", **acc, stale=f"{metrics['staleness_mean']:.2f}",
                             sps=f"{samples_per_s:.0f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        for writer in self.writers:
            writer.flush()
            writer.close()

    def summary(self, **extra) -> dict:
        """The end-of-run record; also written to ``summary.json``: ``wall_s`` every attempt's RL
        seconds, ``attempt_wall_s`` this attempt's when there were earlier ones."""
        elapsed = time.perf_counter() - self.start
        result = {
            "wall_s": round(self.earlier_s + elapsed, 2),
            **({"attempt_wall_s": round(elapsed, 2)} if self.earlier_s else {}),
            "samples_trained": self.samples,
            **({"samples_replayed": self.replayed} if self.replayed else {}),
            "staleness_histogram": {int(k): v for k, v in sorted(self.staleness.items())},
            **extra,
        }
        (self.out_dir / "summary.json").write_text(json.dumps(result, indent=2))
        return result


def episode_summary(workers: dict, log: Path) -> dict:
    """The run's episodes of a rollout node, from the generation replicas' reports
    (``workers``: name -> report with ``episodes``, ``episodes_failed``, ``episode_errors``):
    ``{"played", "failed", "errors": {summary line: failed episodes}, "log": log}`` (``log``
    only when the file exists: the first traceback of each error); ``{}`` without episodes."""
    reports = [w for w in workers.values() if isinstance(w, dict) and "episodes" in w]
    if not reports:
        return {}
    errors = Counter()
    for w in reports:
        errors.update(w.get("episode_errors", {}))
    out = {"played": sum(w["episodes"] for w in reports), "failed": sum(w["episodes_failed"] for w in reports),
           "errors": dict(errors.most_common())}
    if log.is_file():
        out["log"] = str(log)
    return out


def _generator_lines(workers: dict) -> list[str]:
    """The generation replicas' engine dtypes (``gen.dtype=auto`` decides at start, with the measured
    decode-step speedup over fp32) and their prompts over the plan's budget, one line each."""
    reports = {name: w for name, w in workers.items() if isinstance(w, dict) and "engine_dtype" in w}
    lines = []
    if reports:
        lines.append("generation engines: " + ", ".join(
            f"{name} {w['engine_dtype']}" + (f" (auto: decode step {w['engine_dtype_speedup']:.2f}x fp32's)"
                                             if "engine_dtype_speedup" in w else "")
            for name, w in sorted(reports.items(), key=_by_worker)))
    over = {name: w for name, w in workers.items() if isinstance(w, dict) and w.get("prompts_over_budget")}
    if over:
        lines.append("prompts longer than the plan's budget (compile.max_prompt_len): " + ", ".join(
            f"{name} {w['prompts_over_budget']} (longest {w['longest_prompt']} tokens)"
            for name, w in sorted(over.items(), key=_by_worker)))
    return lines


def _lending_lines(workers: dict) -> list[str]:
    """What the local workers lent and borrowed (``runtime.core_lending``), one line; none when
    no worker took part."""
    lending = {name: w["core_lending"] for name, w in workers.items() if isinstance(w, dict) and "core_lending" in w}
    if not lending:
        return []
    return ["idle cores lent (scheduler.lend_idle_cores): " + ", ".join(
        f"{name} lent its {c['own_threads']} thread(s) {c['lent_s']:.1f} s" if not c["phases"] else
        f"{name} ran {c['borrowed']} of {c['phases']} phases on lent threads (own {c['own_threads']}, "
        f"at most {c['most_threads']}), lent its own {c['lent_s']:.1f} s"
        for name, c in sorted(lending.items(), key=_by_worker))]


def _by_worker(item: tuple[str, object]) -> tuple[str, int]:
    """Sort key of a ``(worker name, value)`` pair: group, then rank as a number (``generate/2``
    before ``generate/10``)."""
    group, _, rank = item[0].rpartition("/")
    return (group, int(rank)) if rank.isdigit() else (item[0], -1)


def format_summary(summary: dict) -> str:
    """Human-readable end-of-run report."""
    lines = ["", "=== run summary ==="]
    if "accuracy_before" in summary:
        before, after = summary["accuracy_before"], summary["accuracy_after"]
        lines.append(f"held-out {summary.get('eval_kind', 'greedy accuracy')}: before RL {before:.1%}  after RL {after:.1%}  ({100 * (after - before):+.1f} points)")
    if "episodes_before" in summary and "episodes_after" in summary:
        before, after = summary["episodes_before"], summary["episodes_after"]
        lines.append("held-out episodes, before -> after RL: " + ", ".join(
            f"{key} {before[key]:.3g} -> {after[key]:.3g}" for key in before if key in after))
    if "answer_kinds_before" in summary and "answer_kinds_after" in summary:
        before, after = summary["answer_kinds_before"], summary["answer_kinds_after"]
        lines.append("held-out greedy answers by kind, before -> after RL: "
                     + ", ".join(f"{kind} {before[kind]} -> {after[kind]}" for kind in before))
    attempt = f" (this attempt {summary['attempt_wall_s']:.1f} s)" if "attempt_wall_s" in summary else ""
    lines.append(f"RL wall time: {summary['wall_s']:.1f} s{attempt}   samples trained: {summary['samples_trained']}"
                 + (f" (+{summary['samples_replayed']} replayed)" if summary.get("samples_replayed") else ""))
    episodes = summary.get("episodes")
    if episodes:
        played, failed = episodes["played"], episodes["failed"]
        lines.append(f"episodes: {played} played, {failed} failed ({failed / max(played, 1):.1%}; left out of training)"
                     + (":" if episodes["errors"] else ""))
        lines += [f"  {n:6d} x {line}" for line, n in episodes["errors"].items()]
        if "log" in episodes:
            lines.append(f"  first traceback of each: {episodes['log']}")
    lines += _generator_lines(summary.get("workers", {}))
    lines += _lending_lines(summary.get("workers", {}))
    hist = summary["staleness_histogram"]
    total = sum(hist.values()) or 1
    lines.append("staleness histogram (versions between generation and training):")
    for k, count in hist.items():
        lines.append(f"  {k}: {count:6d}  {'#' * max(1, round(40 * count / total))}")
    for key in ("out_dir", "model_dir", "trajectories"):
        if key in summary:
            lines.append(f"{key}: {summary[key]}")
    return "\n".join(lines)
