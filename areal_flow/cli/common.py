"""What the command line's subcommands share: the user-error type, loading a graph file, and
its experiment config.

Owns the rule that a graph file's config defaults to the YAML file of the same name beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import cloudpickle

from areal_flow.dsl import Flow


class CLIError(Exception):
    """A user error on the command line; printed without a traceback."""


def load_flow(path: str | Path, name: str | None = None) -> Flow:
    """Import a graph file and return its ``@flow`` (the one named ``name`` if several).

    Raises:
        CLIError: the file is missing, is a folder (listing its graph files), is not a ``.py`` file, fails
            to import (with its error), or holds no (or several, without ``name``) ``@flow`` functions.
    """
    path = Path(path)
    if path.is_dir():
        found = _graph_files(path)
        listing = f"pass one of its graph files: {', '.join(found)}" if found else "it holds no *.py file with an @flow"
        raise CLIError(f"{path}: a folder, not a graph file; {listing}")
    if not path.is_file():
        raise CLIError(f"graph file not found: {path}")
    spec = importlib.util.spec_from_file_location(f"areal_flow_graph_{path.stem}", path)
    if path.suffix != ".py" or spec is None:
        raise CLIError(f"{path}: not a graph file (a Python file defining an @flow function, *.py)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    # Workers (Ray actors, other machines) cannot import this file by its made-up module
    # name: cloudpickle sends the functions defined in it (reward functions, algorithms) by value.
    cloudpickle.register_pickle_by_value(module)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise CLIError(f"{path}: importing the graph file failed: {type(exc).__name__}: {exc}") from exc
    flows = {obj.name: obj for obj in vars(module).values() if isinstance(obj, Flow)}
    if name is not None:
        if name not in flows:
            raise CLIError(f"{path}: no @flow named {name!r}; found: {', '.join(flows) or 'none'}")
        return flows[name]
    if not flows:
        raise CLIError(f"no @flow function in {path}")
    if len(flows) != 1:
        raise CLIError(f"{path}: expected exactly one @flow, found {len(flows)} ({', '.join(flows)}); pass --flow NAME")
    return next(iter(flows.values()))


def _graph_files(folder: Path) -> list[str]:
    """The ``*.py`` files directly in ``folder`` whose text has an ``@flow`` decorator (sorted paths)."""
    return sorted(str(f) for f in folder.glob("*.py") if "@flow" in f.read_text(errors="replace"))


def default_config_path(flow: Flow, given: str | None) -> str | None:
    """``given`` (``--config``), else the ``.yaml`` of the graph file's name beside it when there
    is one, else None (the built-in defaults)."""
    if given is not None:
        return given
    candidate = Path(flow.source_file).with_suffix(".yaml")
    return str(candidate) if candidate.is_file() else None


def flow_config(flow: Flow, args: argparse.Namespace):
    """The experiment config of a graph command: ``--config`` (else the yaml beside the graph
    file) with the command's overrides; the run is named after the flow unless ``name`` is set."""
    from areal_flow.config_load import load_config

    cfg = load_config(default_config_path(flow, args.config), args.overrides)
    if cfg.name == "experiment":
        cfg.name = flow.name
    return cfg


def check_output_folder(path: str | None) -> None:
    """Raises CLIError when ``path``'s folder does not exist (before any work is done)."""
    if path is not None and not Path(path).parent.is_dir():
        raise CLIError(f"{path}: output folder {Path(path).parent} does not exist")


def note_defaults(flow: Flow, config: str | None) -> None:
    """Say on stderr, in one line, that a graph file with no YAML beside it and no ``--config``
    (``config``) runs on the built-in defaults, naming the file looked for and ``--config``.

    A note, not a refusal: as for a Hydra app with a structured config and no config file, the
    defaults are a whole config, and a graph file of one's own beside no YAML must still run;
    the silence was the bug. The commands print it once the graph is traced, so a bad graph
    still gets its one error line alone, and a run shows it before its long work starts.
    """
    if default_config_path(flow, config) is None:
        looked = Path(flow.source_file).with_suffix(".yaml")
        print(f"areal-flow: note: no {looked} beside the graph file: using the built-in defaults ('areal-flow "
              "config' lists them) and the overrides; pass --config FILE to use a YAML config", file=sys.stderr)
