"""Helpers of the tests that run a whole job: the CLI in a subprocess, and its trajectories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def records(out: Path) -> list[dict]:
    """The trained trajectories of the run in ``out`` (one dict per sample, in training order)."""
    return [json.loads(line) for line in (out / "trajectories" / "trajectories.jsonl").read_text().splitlines()]


def cli_run(graph: Path, *overrides: str, timeout_s: float = 600) -> None:
    """``areal-flow run graph overrides...`` in a subprocess; fails the test with its stderr tail."""
    proc = subprocess.run([sys.executable, "-m", "areal_flow.cli", "run", str(graph), *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
