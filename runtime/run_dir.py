"""The run folder ``<out_dir>/<name>/``: every run starts in an empty one.

Owns what happens when a run's folder already holds an earlier run: the earlier folder
is renamed to ``<name>.old-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... appended when that name
is taken) and the new run gets a fresh, empty folder, so no event file, trajectory,
checkpoint or model of the earlier run sits beside the new one and nothing is deleted.
(There is no resume: a rerun is a new run; move or delete old folders yourself.)
"""

from __future__ import annotations

import time
from pathlib import Path


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
