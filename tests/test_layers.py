"""The layers import only downward: areal_flow <- compiler <- runtime <- areal_flow.cli.

The contracts live in pyproject.toml ([tool.importlinter]) and are checked by import-linter;
these tests run them, check that the list of areal_flow's core modules is complete, prove
that a back-import breaks them, and check what each layer's entry module loads.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("areal_flow", "compiler", "runtime")


def _lint(root: Path) -> int:
    """import-linter's exit code for the contracts in ``root``'s pyproject.toml, importing the
    packages from ``root`` (0: every contract kept). In a subprocess: ``lint_imports`` configures
    logging (``dictConfig``), which would disable the loggers of modules other tests imported."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(root / 'pyproject.toml')!r}, no_cache=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=root, env={"PYTHONPATH": str(root), "PATH": ""},
                          capture_output=True, text=True).returncode


def test_the_layer_contracts_are_kept():
    assert _lint(REPO) == 0


def test_the_core_contract_names_every_module_of_areal_flow_but_the_cli():
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    core = next(c for c in contracts if c["type"] == "forbidden")
    children = {f"areal_flow.{p.stem if p.is_file() else p.name}" for p in (REPO / "areal_flow").iterdir()
                if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert set(core["source_modules"]) == children - {"areal_flow.cli"}


@pytest.mark.parametrize("back_import", [
    ("areal_flow/graph.py", "import runtime.launch"),       # core -> runtime
    ("compiler/plan.py", "import areal_flow.cli"),          # compiler -> application
    ("runtime/router.py", "import areal_flow.cli.run"),     # runtime -> application
    ("runtime/router.py", "import runtime.launch"),         # a cycle inside runtime (launch imports router)
])
def test_a_back_import_breaks_a_contract(tmp_path, back_import):
    for name in PACKAGES:
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    assert _lint(tmp_path) == 0  # the copy keeps the contracts...
    path, line = back_import
    with open(tmp_path / path, "a") as f:
        f.write(f"\n{line}  # noqa\n")
    assert _lint(tmp_path) == 1  # ...until one back-import is added


def _loaded(module: str) -> set[str]:
    """The project modules (and torch) that ``import module`` loads in a fresh interpreter."""
    code = (f"import sys, {module}; print(' '.join(m for m in sys.modules "
            "if m.split('.')[0] in ('areal_flow', 'compiler', 'runtime', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_each_layer_loads_only_what_is_below_it():
    core = _loaded("areal_flow.graph")
    assert not {m for m in core if m.split(".")[0] in ("compiler", "runtime", "torch")}
    compiler = _loaded("compiler.compile")
    assert not {m for m in compiler if m.startswith(("runtime", "areal_flow.cli", "torch"))}
    plan_reader = _loaded("runtime.launch")  # the runtime's entry: it reads plans, it compiles none
    assert "areal_flow.cli" not in plan_reader and "areal_flow.dsl" not in plan_reader
    assert not {m for m in plan_reader if m in ("compiler.search", "compiler.compile", "compiler.program")}
