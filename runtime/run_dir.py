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
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from pathlib import Path

from runtime.record import rewind_records
from runtime.trace import mark_attempt


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


def rewind_run_dir(folder: Path, version: int) -> tuple[int, Counter]:
    """Make run ``folder`` continue from the checkpoint of policy ``version``: keep the
    trajectories of steps ``< version`` in ``trajectories/trajectories.jsonl`` (later lines
    were trained by the attempt that did not reach the next checkpoint; they are trained
    again), likewise the ``debug.record`` records of those steps (``runtime.record.rewind_records``),
    remove unfinished checkpoint folders (``checkpoints/*.tmp``), and mark the new
    attempt in the timeline (``runtime.trace.mark_attempt``; the earlier spans are kept).

    Returns:
        the samples kept and their staleness histogram (versions -> samples), so the run's
        summary counts the whole run.

    Raises:
        ValueError: a line of the trajectories file is not JSON (names the file and line).
    """
    samples, staleness = 0, Counter()
    path = folder / "trajectories" / "trajectories.jsonl"
    if path.is_file():
        kept = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a trajectory record ({e})") from None
            if record["step"] < version:
                kept.append(line)
                samples += 1
                staleness[record["staleness"]] += 1
        path.write_text("".join(f"{line}\n" for line in kept))
    for tmp in (folder / "checkpoints").glob("*.tmp"):
        shutil.rmtree(tmp)
    rewind_records(folder, version)
    mark_attempt(folder, version)
    return samples, staleness
