"""pass@k (Chen et al. 2021, eq. 1) against hand-computed values; the eval command's errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.evaluate import build_eval_task, pass_at_k

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 1 / 4),              # pass@1 = c / n
    (5, 2, 2, 1 - 3 / 10),         # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 1 - 21 / 252),      # 1 - C(7,5)/C(10,5) = 1 - 21/252 = 11/12
    (10, 0, 3, 0.0),               # nothing correct
    (5, 4, 2, 1.0),                # n - c = 1 < k: every pair holds a correct sample
    (8, 8, 8, 1.0),
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_bad_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_eval_tasks():
    plain, chat = build_eval_task("arith", seed=1), build_eval_task("arith-chat", seed=1)
    a, b = plain.test_set(3), chat.test_set(3)
    assert [p["answer"] for p in a] == [p["answer"] for p in b]  # the same problems, asked two ways
    assert a[0]["prompt"].endswith("=") and b[0]["prompt"].startswith("What is")
    with pytest.raises(ValueError, match="--task 'mmlu'"):
        build_eval_task("mmlu")


def test_eval_bad_model_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "areal_flow.cli", "eval", str(tmp_path / "nothing.gguf"),
                          "--task", "arith", "--n", "2"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "nothing.gguf" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
