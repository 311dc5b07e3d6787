"""What a run under ``bench/chaos.py`` wrote, as the bench reads it: the last step of its
``steps.jsonl``, the lines its console log said, and the steps its TensorBoard events show.

Owns reading only (never writing, never processes): the run folder's layout is
docs/RESUME.md's, the console lines are ``runtime/restarts.py``'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def last_step(run_dir: Path, since: float = 0.0) -> int:
    """The step of the last complete line of ``steps.jsonl`` (-1: none, or the file was last
    written before ``since``, a ``time.time()``: by an attempt that is gone)."""
    try:
        with (run_dir / "steps.jsonl").open("rb") as f:
            if os.fstat(f.fileno()).st_mtime < since:
                return -1
            f.seek(max(0, f.seek(0, 2) - 16384))
            lines = f.read().split(b"\n")[:-1]
        return json.loads(lines[-1])["step"] if lines else -1
    except (OSError, ValueError, KeyError, IndexError):
        return -1


def said(log: Path) -> list[str]:
    """The ``areal-flow:`` lines of an attempt's console log."""
    return [x.strip() for x in log.read_text(errors="replace").replace("\r", "\n").splitlines() if "areal-flow:" in x]


def last_line(log: Path) -> str:
    """The last ``areal-flow:`` line of an attempt's console log (what it said last)."""
    lines = said(log)
    return lines[-1][:240] if lines else "(no areal-flow line)"


def final_line(log: Path) -> str:
    """The last line of an attempt's console log that is not its progress bar (a failed run's
    one-line error, or its traceback's exception)."""
    lines = [x.strip() for x in log.read_text(errors="replace").replace("\r", "\n").splitlines()
             if x.strip() and not x.startswith("rl:")]
    return lines[-1][:240] if lines else "(nothing)"


def restart_said(lines: list[str]) -> str:
    """What the runtime said it did after a worker's death, in a few words."""
    restarts = [x for x in lines if " died (" in x]
    if not restarts:
        return "no restart said (the run went on)"
    line = restarts[-1]
    if "restarting every worker" in line:
        return "runtime restarted every worker from " + line.split("restarting every worker from ")[1].split(" at")[0]
    return "runtime restarted " + line.split("areal-flow: ")[1].split(" died")[0]


def event_steps(run_dir: Path, tag: str = "rl/reward") -> list[int]:
    """The steps TensorBoard shows for ``tag`` over every event file of the run (all kept)."""
    from runtime.metrics import read_events

    acc = read_events(run_dir)
    return [e.step for e in acc.Scalars(tag)]
