"""The run folder's writer fence: a trainer of an attempt that was given up stops writing.

Owns who may write a run's step records (``trajectories/trajectories.jsonl``, ``steps.jsonl``),
checkpoints and final model. When the driver gives up an attempt (a dead trainer, a lost Ray
node) its processes are not always gone: on Ray a worker whose node's raylet died can train on
and write for a while (``bench/chaos.py`` saw 89 steps), while the next attempt rewinds the
folder and trains the same steps again, so the two attempts' lines would interleave.

The fence is one file, ``<run>/writer.fence``, holding a token. A trainer claims it when it
starts (:func:`claim`: a fresh token) and checks it before each write (:func:`check`); the
driver's rewind before a new attempt (``runtime.run_dir.rewind_run_dir``) claims it too, so a
trainer of the given-up attempt finds another token at its next write and stops with
:class:`Superseded`, writing nothing more. What it does not close: a write already past its
check when the token changes (the window is one step's records, microseconds of file
appends) — the rewind's cut drops what such a write leaves after the kept lines.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

FENCE_FILE = "writer.fence"


class Superseded(RuntimeError):
    """This trainer's attempt was given up: another attempt (or the rewind before it) holds the
    run folder's writer fence."""


def claim(folder: Path) -> str:
    """Write a fresh token to ``folder``'s fence (atomically: a temporary file renamed over it)
    and return it; every earlier holder's next :func:`check` fails."""
    token = f"{os.getpid()}-{uuid.uuid4().hex}"
    tmp = Path(folder) / f"{FENCE_FILE}.{token}.tmp"
    tmp.write_text(token)
    os.replace(tmp, Path(folder) / FENCE_FILE)
    return token


def check(folder: Path, token: str, what: str) -> None:
    """Raise :class:`Superseded` unless ``folder``'s fence still holds ``token``.

    Args:
        what: the write about to happen, for the message (e.g. ``"step 12's records"``).
    """
    try:
        held = (Path(folder) / FENCE_FILE).read_text()
    except FileNotFoundError:
        held = ""
    if held != token:
        raise Superseded(f"{folder}: not writing {what}: this trainer's attempt was given up (the run folder's "
                         f"{FENCE_FILE} is held by a later attempt)")
