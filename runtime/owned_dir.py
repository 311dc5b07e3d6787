"""Temporary folders owned by one live process: made fresh, removed by their owner, and swept
by the next owner of the same kind when the one that made them died without removing them.

Two kinds: a local run attempt's ``ipc://`` socket folder (:data:`SOCKETS`, owned by the
driver) and a rank launcher's folder of return values (:data:`RANKS`, owned by the process
that called ``runtime.parallel.launch.spawn_workers``). A folder is
``<tmp>/<prefix><owner pid>-<random>`` (``tempfile.mkdtemp``, mode 0700): the owner's pid in
the name lets a later owner tell a folder whose owner was SIGKILLed (no handler ran, so
nothing removed it) from one a live process still uses. Owns the folders' names and
lifetimes only, not what is in them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

SOCKETS = "areal-flow-"
RANKS = "areal-flow-ranks-"


def _owner_dead(folder: Path, prefix: str) -> bool:
    """Whether ``folder`` (``<prefix><pid>-<random>``, this user's) names a pid no longer running."""
    pid = folder.name[len(prefix):].split("-", 1)[0]
    if not pid.isdigit() or folder.stat().st_uid != os.getuid():
        return False  # another kind's folder (its pid field is not a number), or not ours
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # a live process of another user
        return False
    return False


def sweep_stale_dirs(prefix: str) -> list[Path]:
    """Remove the ``prefix`` folders in the temporary directory whose owner is dead; return them.

    A folder whose pid is alive is kept, whoever that process is now (a reused pid keeps a
    stale folder a while longer, never removes a live one's)."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{prefix}*-*"):
        try:
            if folder.is_dir() and _owner_dead(folder, prefix):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
        except OSError:  # removed meanwhile by another owner's sweep
            continue
    return removed


def new_owned_dir(prefix: str) -> str:
    """Sweep the stale ``prefix`` folders, then make this process's (0700): its path."""
    sweep_stale_dirs(prefix)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")


def remove_owned_dir(folder: str | None) -> None:
    """Remove an owned folder and what was left in it (nothing if None)."""
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
