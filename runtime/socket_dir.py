"""The folder of a local run attempt's ``ipc://`` sockets: made fresh, removed after the
attempt, and swept when the driver that made it died without removing it.

Owns the folder's name and lifetime only (the addresses in it are ``runtime.launch``'s). The
folder is ``<tmp>/areal-flow-<driver pid>-<random>`` (``tempfile.mkdtemp``, mode 0700): the
driver's pid in the name lets a later driver tell a folder whose driver was SIGKILLed (no
handler ran, so nothing removed it) from one a live run still uses.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "areal-flow-"


def _driver_dead(folder: Path) -> bool:
    """Whether ``folder`` (``areal-flow-<pid>-<random>``, this user's) names a pid no longer running."""
    pid = folder.name[len(PREFIX):].split("-", 1)[0]
    if not pid.isdigit() or folder.stat().st_uid != os.getuid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # a live process of another user
        return False
    return False


def sweep_stale_socket_dirs() -> list[Path]:
    """Remove the socket folders in the temporary directory whose driver is dead; return them.

    A folder whose pid is alive is kept, whoever that process is now (a reused pid keeps a
    stale folder a while longer, never removes a live run's)."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        try:
            if folder.is_dir() and _driver_dead(folder):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
        except OSError:  # removed meanwhile by another driver's sweep
            continue
    return removed


def new_socket_dir() -> str:
    """Sweep stale socket folders, then make this attempt's (0700): its path."""
    sweep_stale_socket_dirs()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def remove_socket_dir(folder: str | None) -> None:
    """Remove an attempt's socket folder and what its workers left in it (nothing if None)."""
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
