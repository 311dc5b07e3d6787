"""The ``areal-flow run`` command: a graph or a saved plan, and what ``--resume`` accepts.

Owns the run command's argument checks (the ``--resume`` folder, and ``name``/``out_dir`` and
the allocation taken from it); the run itself is the runtime's (``runtime.launch``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from areal_flow.cli.common import CLIError, flow_config, load_flow, note_defaults
from areal_flow.config import ConfigError
from areal_flow.dsl import Flow


def run_command(args: argparse.Namespace) -> int:
    """``areal-flow run``: a graph file with its config and overrides, or ``--plan PLAN.json``;
    with ``--resume`` (see :func:`resume_folder`). ``--resume RUN_FOLDER`` alone runs the run
    folder's own program (``RUN_FOLDER/plan.json``), so a resume repeats none of the graph's overrides,
    in the folder where it now is (its ``name`` and ``out_dir``: a folder moved aside or copied).

    Raises:
        CLIError: bad arguments, naming them (``--plan`` with a graph file, a missing file, a
            ``--resume`` folder that cannot be one, ``--resume`` with a different ``resume=``,
            ``name=``/``out_dir=`` other than the ``--resume`` folder's, overrides with ``--resume``
            alone).
    """
    the_runs_plan = not args.plan and not args.file and args.resume and args.resume != "auto"
    if the_runs_plan:
        if args.overrides or args.config or args.flow:
            raise CLIError(f"--resume {args.resume} without a graph file runs the folder's plan.json as it is: "
                           "overrides need the graph file too (areal-flow run GRAPH.py KEY=VALUE --resume RUN_FOLDER)")
        args.plan = str(resume_folder(args.resume) / "plan.json")
    if args.plan:
        from compiler.plan import Plan
        from compiler.strategy import StrategyError
        from runtime.launch import run

        if args.file or args.overrides or args.config or args.flow:
            raise CLIError("run --plan PLAN.json takes no graph file, --config, --flow or overrides: the plan is the "
                           "whole program (edit it, or compile a new one)")
        path = Path(args.plan)
        if not path.is_file():
            raise CLIError(f"plan file not found: {path}")
        if args.resume and args.resume != "auto":
            folder = resume_folder(args.resume)
        plan = Plan.from_json(path.read_text(), source=str(path))
        if the_runs_plan:  # the folder is the run, wherever it now is (moved aside or copied)
            plan = dataclasses.replace(plan, run={**plan.run, "name": folder.name, "out_dir": str(folder.parent)})
        try:
            run(plan, resume=args.resume or "")
        except (ConfigError, StrategyError) as exc:  # a value the config's checks (runtime.preflight) or a
            raise CLIError(f"{path}: {exc}") from None  # strategy the runtime's rules (compiler.executable) refuse
        return 0
    if not args.file:
        raise CLIError("run needs a graph file, or --plan PLAN.json")
    if "=" in args.file and not Path(args.file).exists():  # argparse took the first override for the graph
        raise CLIError(f"{args.file} is an override (KEY=VALUE), not a graph file: overrides follow the graph file "
                       "(areal-flow run GRAPH.py KEY=VALUE ...); --resume RUN_FOLDER alone runs the folder's "
                       "plan.json and takes none")
    flow = load_flow(args.file, args.flow)
    cfg = flow_config(flow, args)
    if args.resume:
        if cfg.resume and cfg.resume != args.resume:
            raise CLIError(f"--resume {args.resume} and resume={cfg.resume} both given; pass one of them")
        if args.resume != "auto":
            folder = resume_folder(args.resume)
            given = dict(o.split("=", 1) for o in args.overrides if o.startswith(("name=", "out_dir=")))
            for key, own in (("name", folder.name), ("out_dir", str(folder.parent))):
                value = given.get(key)
                same = value is None or (Path(value).resolve() == Path(own).resolve() if key == "out_dir"
                                         else value == own)
                if not same:
                    raise CLIError(f"--resume {args.resume} is the run folder of {key}={own}, but {key}={value} "
                                   f"was also given; drop {key}= (the run folder sets it)")
            cfg.name, cfg.out_dir = folder.name, str(folder.parent)
            keep_allocation(cfg, folder)
        cfg.resume = args.resume
    return run_flow(flow, cfg, args.config)


def keep_allocation(cfg, folder: Path) -> None:
    """A resume with a graph file keeps the run's allocation: ``cfg.compile.allocation`` is set to
    the folder's ``plan.json`` one when the config gives none and the cluster is the run's
    (``cluster.gpu``, ``n_nodes``, ``n_gpus_per_node``), so a resume places the job where it ran
    (as verl and AReaL resume it) instead of where today's search would (the plan the run prints
    shows it). Another cluster, or ``compile.allocation=...``, places it anew (the checkpoint
    reshards, docs/RESUME.md)."""
    if cfg.compile.allocation:
        return
    saved = json.loads((folder / "plan.json").read_text())
    cluster = {k: getattr(cfg.cluster, k) for k in ("gpu", "n_nodes", "n_gpus_per_node")}
    if not saved.get("allocation") or {k: saved.get("cluster", {}).get(k) for k in cluster} != cluster:
        return
    cfg.compile.allocation = saved["allocation"]


def resume_folder(arg: str) -> Path:
    """The run folder ``--resume`` names (``runs/<name>``).

    Raises:
        CLIError: the folder does not exist, is a checkpoint folder inside a run folder (names
            the run folder to pass), or holds no ``plan.json``.
    """
    folder = Path(arg)
    if not folder.is_dir():
        raise CLIError(f"--resume {arg}: no such folder (pass a run folder, runs/<name>)")
    if folder.resolve().parent.name == "checkpoints" and folder.name.startswith("version_"):
        run = folder.resolve().parent.parent
        raise CLIError(f"--resume {arg}: a checkpoint folder; pass the run folder {run} (a resume continues from "
                       "its last complete checkpoint)")
    if not (folder / "plan.json").is_file():
        raise CLIError(f"--resume {arg}: not a run folder (no plan.json); runs write runs/<name>/")
    return folder


def run_experiment(graph, cfg, show_progress: bool = True) -> dict:
    """Compile ``graph`` under ``cfg`` into a plan and run it (``areal-flow run graph.py``): the
    application layer's compile-and-run; the runtime itself reads only the plan
    (``runtime.launch.run``). The run folder keeps ``cfg`` as ``config.yaml``."""
    from areal_flow.config_load import config_yaml
    from compiler.program import compile_program
    from runtime.launch import run

    return run(compile_program(graph, cfg), show_progress, resume=cfg.resume, config_yaml=config_yaml(cfg))


def run_flow(flow: Flow, cfg, config: str | None = None) -> int:
    """Trace ``flow`` under ``cfg``, then compile and run it; ``config`` is the ``--config`` given
    (``areal_flow.cli.common.note_defaults``)."""
    graph = flow(cfg)
    note_defaults(flow, config)
    if sys.stderr.isatty():  # the import alone takes seconds; a log or pipe keeps a bad input's error one line
        print(f"areal-flow: run {flow.name}: loading the runtime (torch) and compiling the plan", file=sys.stderr,
              flush=True)
    run_experiment(graph, cfg)  # compile the plan, then run it (the plan is all the runtime reads)
    return 0
