"""bench/gpu_check.sh --dry-run on CPU: prints its commands and validates them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~30 s: six CLI processes
def test_dry_run_validates_every_step(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path)}
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for step in ("[install]", "[eval_before]", "[grpo_embedded]", "[eval_after]", "[vllm_engine]", "[throughput]",
                 "[nccl_dp2]"):
        assert step in out.stdout
    assert out.stdout.rstrip().endswith("dry run: ok")
    assert list(tmp_path.iterdir()) == []  # a dry run writes no results


def test_unknown_argument_is_one_line():
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--wet"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip() == "gpu_check.sh: unknown argument --wet (use --dry-run, --out FILE)"
