"""The run folder ``<out_dir>/<name>/``: a new run starts in an empty one, a resumed run
continues in its own.

Owns what happens when a run's folder already holds an earlier run. A new run: the earlier
folder is renamed to ``<name>.old-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... appended when that
name is taken) and the new run gets a fresh, empty folder, so no event file, trajectory,
checkpoint or model of the earlier run sits beside the new one and nothing is deleted. A
resumed run (``--resume``, ``resume=auto``, or a trainer restarted from its last checkpoint,
``runtime.checkpoint``): the folder is kept, and what was written after the checkpoint is
undone (:func:`rewind_run_dir`) so every trained sample is in ``trajectories/`` once; the
timeline's span files are kept and the new attempt is marked in them (``runtime.trace``).

Moved-aside folders do not pile up: after a move, :func:`prune_old_runs` deletes all but the
newest ``keep_old_runs`` (``plan.run``, default 3) ``<name>.old-*`` folders of that name, and
nothing else. The folder explains itself (:func:`record_start`): ``config.yaml`` is the
resolved config the run was compiled from (absent for ``run --plan``: ``plan.json`` is the
whole program), and ``commands.jsonl`` gets one line per start of the run (the new run, each
resume) with the process's command line, working folder, time and git commit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from areal_flow.types import REPLAYED
from runtime.record import rewind_records
from runtime.trace import mark_attempt
from runtime.writer_fence import claim as claim_fence


def fresh_run_dir(folder: Path, now: float | None = None) -> Path | None:
    """Make ``folder`` an empty directory; return where an earlier run's folder was moved
    (None when there was none, or it was empty).

    Args:
        now: the time stamped on the moved folder, seconds since the epoch (default: now).

    Raises:
        OSError: the folder cannot be created or renamed (e.g. permissions); names the path.
    """
    moved = None
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        moved = folder.with_name(f"{folder.name}.old-{stamp}")
        n = 1
        while moved.exists():
            n += 1
            moved = folder.with_name(f"{folder.name}.old-{stamp}-{n}")
        try:
            folder.rename(moved)
        except OSError as e:
            raise OSError(f"run folder {folder} holds an earlier run and cannot be moved to {moved}: {e}") from e
    folder.mkdir(parents=True, exist_ok=True)
    return moved


def prune_old_runs(folder: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` folders that :func:`fresh_run_dir` moved ``folder``
    aside to (``<name>.old-<YYYYmmdd-HHMMSS>[-<n>]`` beside it, by stamp and counter); return
    the deleted ones, oldest first. No other folder is touched.

    Raises:
        OSError: a folder cannot be deleted (names it).
    """
    pattern = re.compile(re.escape(folder.name) + r"\.old-(\d{8}-\d{6})(?:-(\d+))?")
    old = []
    for path in folder.parent.iterdir() if folder.parent.is_dir() else ():
        match = pattern.fullmatch(path.name)
        if match and path.is_dir() and not path.is_symlink():
            old.append(((match[1], int(match[2] or 1)), path))
    doomed = [path for _, path in sorted(old)][:max(len(old) - keep, 0)]
    for path in doomed:
        try:
            shutil.rmtree(path)
        except OSError as e:
            raise OSError(f"cannot delete the earlier run {path} (keep_old_runs={keep}): {e}") from e
    return doomed


def record_start(folder: Path, config_yaml: str | None, now: float | None = None) -> None:
    """Write ``config.yaml`` (when given) and append this start to ``commands.jsonl`` in run
    ``folder`` (module doc): ``argv`` (the process's whole command line, ``sys.orig_argv``),
    ``cwd``, ``time`` (local ISO 8601), ``git_commit`` of the working folder's repository and
    ``git_dirty`` (tracked files changed), both None outside a repository."""
    if config_yaml is not None:
        (folder / "config.yaml").write_text(config_yaml)
    commit, dirty = _git_state(Path.cwd())
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now))
    line = {"argv": list(sys.orig_argv), "cwd": os.getcwd(), "time": stamp, "git_commit": commit, "git_dirty": dirty}
    with (folder / "commands.jsonl").open("a") as fh:
        fh.write(json.dumps(line) + "\n")


def _git_state(where: Path) -> tuple[str | None, bool | None]:
    """``(HEAD commit, tracked files changed)`` of the git repository holding ``where``;
    ``(None, None)`` when there is none (or no ``git``)."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit.strip(), None if status is None else bool(status.strip())


STEPS_FILE = "steps.jsonl"
"""In a run folder: the trainer's metrics of each step (``runtime.observe.step_metrics``), one
JSON line each, written before the step's checkpoint; a resumed run logs from it the steps
whose TensorBoard events a killed driver never wrote (``runtime.metrics.RunLogger``)."""


def _keep_before(path: Path, version: int, what: str) -> list[dict]:
    """Keep the lines of JSONL file ``path`` (if any) whose ``step`` is ``< version``; the kept
    records. A last line without its newline, torn by a kill while it was written, is dropped:
    it is of a step after the checkpoint (the trainer writes a step's lines before its checkpoint).
    So are lines that are not JSON after every kept line (said on stderr): a writer of the dead
    attempt still running after the folder was rewound (a Ray actor on a crashed node) writes
    at its old offset past the cut, leaving a hole of NUL bytes before its lines.

    Raises:
        ValueError: a line before a kept one is not JSON (names the file, the line and ``what``
            it should be): the checkpoint's own steps are damaged.
    """
    if not path.is_file():
        return []
    kept, lines, unreadable = [], [], []
    whole = path.read_text(errors="replace").rpartition("\n")[0]  # up to the last newline
    for n, line in enumerate(whole.splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError as e:
            unreadable.append(f"{path}:{n}: not {what} ({e})")
            continue
        if record["step"] < version:
            if unreadable:
                raise ValueError(unreadable[0])
            kept.append(record)
            lines.append(line)
    if unreadable:
        print(f"areal-flow: {unreadable[0]}: dropped with the {len(unreadable)} unreadable line(s) after step "
              f"{version - 1}'s (written after the cut by a writer of the attempt that died)", file=sys.stderr)
    path.write_text("".join(f"{line}\n" for line in lines))
    return kept


def rewind_run_dir(folder: Path, version: int) -> tuple[int, Counter]:
    """Make run ``folder`` continue from the checkpoint of policy ``version``: keep the
    trajectories of steps ``< version`` in ``trajectories/trajectories.jsonl`` (later lines
    were trained by the attempt that did not reach the next checkpoint; they are trained
    again), likewise the step metrics of :data:`STEPS_FILE` and the ``debug.record`` records
    of those steps (``runtime.record.rewind_records``), remove unfinished checkpoint folders
    (``checkpoints/*.tmp``), fence off the given-up attempt's writers (``runtime.writer_fence``),
    and mark the new attempt in the timeline
    (``runtime.trace.mark_attempt``; the earlier spans are kept).

    Returns:
        the samples kept and their staleness histogram (versions -> samples), so the run's
        summary counts the whole run.

    Raises:
        ValueError: a line of the trajectories or steps file before one it keeps is not JSON
            (names the file and line).
    """
    claim_fence(folder)  # a trainer of the given-up attempt still running stops before its next write
    kept = [r for r in _keep_before(folder / "trajectories" / "trajectories.jsonl", version, "a trajectory record")
            if REPLAYED not in r.get("meta", {})]  # a replayed row is no sample of its own
    _keep_before(folder / STEPS_FILE, version, "a step's metrics")
    for tmp in (folder / "checkpoints").glob("*.tmp"):
        shutil.rmtree(tmp)
    rewind_records(folder, version)
    mark_attempt(folder, version)
    return len(kept), Counter(r["staleness"] for r in kept)
