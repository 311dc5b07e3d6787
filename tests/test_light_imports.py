"""Tracing and compiling a graph import no torch and no transformers (the CLI's
``graph`` and ``compile`` stay well under a second of imports)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPILE = ["compile", "graphs/gsm8k_grpo.py", "--config", "graphs/gsm8k_grpo.yaml", "model.path=Qwen2.5-7B",
           "train.batch_size=64", "gen.n_samples=16", "gen.max_new_tokens=4096", "cluster.n_nodes=4",
           "cluster.n_gpus_per_node=8", "cluster.gpu=H100", "--plan"]
PROBE = """
import sys
from areal_flow.cli import main
rc = main(sys.argv[1:])
print("exit", rc, "torch" in sys.modules, "transformers" in sys.modules)
"""


@pytest.mark.parametrize("args", [["graph", "graphs/arith_grpo.py"], "compile"], ids=["graph", "compile"])
def test_graph_and_compile_import_no_torch_or_transformers(args, tmp_path):
    if args == "compile":
        args = [*COMPILE, "-o", str(tmp_path / "plan.json"), "--viz", str(tmp_path / "p.html")]
    out = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "exit 0 False False"


def test_importing_the_library_loads_neither_the_compiler_nor_its_dependencies():
    """``.venv-vllm`` installs the project without its dependencies (see the Makefile): the
    engine code it tests imports ``areal_flow``, which must not pull in ``compiler`` (and
    with it ``xxhash``)."""
    probe = "import sys, areal_flow, areal_flow.ops; print('compiler' in sys.modules, 'xxhash' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
