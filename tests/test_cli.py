"""The command line: one-line errors naming the culprit, and the graph listing."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_flow.cli", *args], cwd=ROOT, capture_output=True, text=True)


def test_graph_command_lists_edges_and_staleness():
    out = _cli("graph", "graphs/arith_grpo.py", "async.max_staleness=3")
    assert out.returncode == 0, out.stderr
    assert "advantage.advantages -> train_step.advantages  [data]  max_staleness=3" in out.stdout


def test_user_errors_are_one_line_without_traceback(tmp_path):
    cases = [
        (("graph", "graphs/arith_grpo.py", "train.lrr=1"), "did you mean 'train.lr'"),
        (("graph", str(tmp_path / "missing.py")), "graph file not found"),
        (("compile", "graphs/arith_grpo.py", "--allocation", "gen:d4x2"), "bad allocation at character 7"),
        (("viz", "plan.json", "-o", "out.txt"), "pick one of these suffixes"),
    ]
    for args, message in cases:
        out = _cli(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert message in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
