"""The ``areal-flow`` command line: ``graph``, ``compile``, ``run``, ``viz``, ``simulate``, ``eval``,
``config``, ``timeline`` and ``replay``.

Owns argument parsing and the loading of graph files (the run command's checks, ``--resume``
included, are ``areal_flow.cli.run``; ``eval``, ``timeline`` and ``replay`` are
``areal_flow.cli.inspect``, what they share ``areal_flow.cli.common``); the work is the compiler's
(``compiler.program.compile_program``) and the runtime's (``runtime.launch.run``).

    areal-flow graph graphs/arith_grpo.py                       # nodes, edges, staleness
    areal-flow compile graphs/gsm8k_grpo.py cluster.n_nodes=4 cluster.n_gpus_per_node=8 --plan
    areal-flow run graphs/arith_grpo.py async.max_staleness=0   # the synchronous baseline
    areal-flow viz plan.json -o placement.html
    areal-flow eval graphs/arith_grpo.py                          # accuracy of the model its run starts from
    areal-flow eval runs/arith_grpo/model --config graphs/arith_grpo.yaml --samples 8   # + pass@k, the run's task
    areal-flow config                                            # every key, its default, aliases
    areal-flow timeline runs/arith_grpo                          # busy/idle per node, waits per edge
    areal-flow timeline runs/arith_grpo --simulate               # + predicted vs measured busy per node
    areal-flow replay runs/arith_grpo --from advantage->train_step   # bit-identical weights per step?

A graph file's config defaults to the YAML file of the same name beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from areal_flow.cli.common import (CLIError, check_output_folder, default_config_path, flow_config, load_flow,
                                   note_defaults)
from areal_flow.dsl import Flow

__all__ = ["CLIError", "build_parser", "default_config_path", "flow_config", "load_flow", "main", "run_main"]


def _cmd_graph(args: argparse.Namespace) -> int:
    flow = load_flow(args.file, args.flow)
    graph = flow(flow_config(flow, args))
    note_defaults(flow, args.config)
    print(graph.describe())
    return 0


VIZ_SUFFIXES = (".html", ".svg", ".png", ".dot")


def _check_viz_path(path: str | None) -> None:
    if path is not None and Path(path).suffix not in VIZ_SUFFIXES:
        raise CLIError(f"{path}: the placement graph is written as {', '.join(VIZ_SUFFIXES)}; pick one of these suffixes")
    check_output_folder(path)


def _render(plan, path: str) -> None:
    """``compiler.viz.render`` with its errors (no Graphviz ``dot`` for .svg/.png) as CLIError."""
    from compiler.render import render

    try:
        render(plan, path)
    except (RuntimeError, ValueError) as exc:
        raise CLIError(f"{path}: {exc}") from None


def check_overwrite(path: str, text: str, force: bool) -> None:
    """Refuse to replace ``path`` when it holds something other than ``text``, unless ``force``:
    a plan file is edited by hand (README), and naming it with ``-o`` does not say the edit may
    go (the README's own command names it). Identical content is rewritten (nothing is lost).

    Raises:
        CLIError: the file exists and differs, naming it and ``--force``.
    """
    target = Path(path)
    if force or not target.exists():
        return
    if target.is_file():
        try:
            if target.read_text() == text:
                return
        except (OSError, UnicodeDecodeError):
            pass
    raise CLIError(f"{path} exists and differs from this plan (an edit of it would be lost); pass --force to "
                   "overwrite it, or -o another path")


def _cmd_compile(args: argparse.Namespace) -> int:
    from compiler import format_table

    _check_viz_path(args.viz)
    check_output_folder(args.output if args.plan else None)
    flow = load_flow(args.file, args.flow)
    cfg = flow_config(flow, args)
    if args.allocation:
        cfg.compile.allocation = args.allocation
    from compiler.program import compile_program

    plan = compile_program(flow(cfg), cfg)
    text = plan.to_json()
    if args.plan:
        check_overwrite(args.output, text, args.force)
    note_defaults(flow, args.config)
    print(format_table(plan))
    if args.plan:
        Path(args.output).write_text(text)
        print(f"plan written to {args.output} (id {plan.id})")
    if args.viz:
        _render(plan, args.viz)
        print(f"placement graph written to {args.viz}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from areal_flow.cli.run import run_command

    return run_command(args)


def _cmd_viz(args: argparse.Namespace) -> int:
    from compiler.plan import Plan, PlanSchemaError

    _check_viz_path(args.output)
    path = Path(args.plan)
    if not path.is_file():
        raise CLIError(f"plan file not found: {path}")
    try:
        plan = Plan.from_json(path.read_text(), source=str(path))
    except (PlanSchemaError, UnicodeDecodeError) as exc:
        message = str(exc).removeprefix("plan.json ")
        raise CLIError(f"{path}: not a plan from 'areal-flow compile --plan': {message}") from None
    _render(plan, args.output)
    print(f"placement graph written to {args.output}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    import json

    from compiler.plan import Plan, PlanSchemaError
    from compiler.simulate import SimulationError, format_report, simulate, spans_json

    path = Path(args.plan)
    if not path.is_file():
        raise CLIError(f"plan file not found: {path}")
    try:
        plan = Plan.from_json(path.read_text(), source=str(path))
        ks = sorted({0, plan.staleness_bound if args.k is None else args.k})
        results = [simulate(plan, k=k, steps=args.steps, seed=args.seed) for k in ks]
    except PlanSchemaError as exc:  # names the file already
        raise CLIError(str(exc)) from None
    except SimulationError as exc:
        raise CLIError(f"{path}: {exc}") from None
    print(format_report(plan, results))
    if args.trace:
        Path(args.trace).write_text(json.dumps({f"k={r.k}": spans_json(r) for r in results}))
        print(f"spans written to {args.trace}")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from areal_flow.config import ExperimentConfig
    from areal_flow.config_load import load_config
    from areal_flow.config_keys import format_listing

    if args.file and "=" in args.file:  # `areal-flow config train.lr=1e-3`: overrides alone
        args.overrides, args.file = [args.file, *args.overrides], None
    if args.file and not args.file.endswith((".yaml", ".yml")):
        raise CLIError(f"{args.file}: config takes a YAML file (a graph's config is the .yaml beside it)")
    if args.file or args.overrides:  # show the resolved values of a graph's config
        from areal_flow.config_load import config_yaml

        print(config_yaml(load_config(args.file, args.overrides)), end="")
        return 0
    print(format_listing(ExperimentConfig))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from areal_flow.cli.inspect import eval_command

    return eval_command(args)


def _cmd_timeline(args: argparse.Namespace) -> int:
    from areal_flow.cli.inspect import timeline_command

    return timeline_command(args)


def _cmd_replay(args: argparse.Namespace) -> int:
    from areal_flow.cli.inspect import replay_command

    return replay_command(args)


EVAL_DOC = """Greedy accuracy (and pass@k with --samples) on the test set of a task, as JSON.
Given a graph file, it evaluates exactly the model a run of that graph starts from: the
graph is compiled with its config (the .yaml beside it, or --config, and the overrides, as
'areal-flow run' does), the policy's start model is made as the run makes it (a tiny
preset: the same warm start, from the same cache) and scored on the run's held-out set
(dataset.*, seed, eval.n_test). Given a model, the config (--config, overrides; none: the
defaults, as a run without a YAML) sets the task and a tiny preset's warm start the same
way. Task names are dataset.name's (arithmetic, gsm8k, longtail)."""


def _add_graph_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument("file", nargs="?" if optional else None, help="graph file (graphs/*.py) holding one @flow")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.lr=1e-4")
    p.add_argument("--config", help="YAML config (default: the .yaml beside the graph file)")
    p.add_argument("--flow", help="which @flow, when the file holds several")


def _at_least(low: int):
    """An argparse type: an int >= ``low`` (refused by the parser, before any work is done)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    summary = " ".join(__doc__.split("\n\n")[0].split()).replace("``", "")  # the module doc's first paragraph
    parser = argparse.ArgumentParser(prog="areal-flow", description=summary)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("graph", help="trace a graph file and print its nodes and edges")
    _add_graph_args(p)
    p.set_defaults(func=_cmd_graph)
    p = sub.add_parser("compile", help="place every node on device meshes; print the plan")
    _add_graph_args(p)
    p.add_argument("--plan", action="store_true", help="write the plan as JSON (see -o)")
    p.add_argument("-o", "--output", default="plan.json", help="plan JSON path (default plan.json)")
    p.add_argument("--force", action="store_true", help="overwrite the plan file even when it differs from this "
                                                        "plan (by default that is refused: it may hold your edit)")
    p.add_argument("--allocation", help='manual allocation, e.g. "gen:d4t2 + train:d2t2p2"')
    p.add_argument("--viz", help="also draw the placement graph (.html, .svg, .png or .dot)")
    p.set_defaults(func=_cmd_compile)
    p = sub.add_parser("run", help="run a graph (compile + run), or a saved plan with --plan")
    _add_graph_args(p, optional=True)
    p.add_argument("--plan", help="run this plan.json (from 'areal-flow compile --plan'); nothing else is read")
    p.add_argument("--resume", metavar="RUN_FOLDER",
                   help="continue the run in RUN_FOLDER (runs/<name>; it sets name and out_dir) from its last "
                        "complete checkpoint; 'auto': resume if the run's folder holds one, else start fresh (config "
                        "key resume)")
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("viz", help="draw a plan.json as a placement graph")
    p.add_argument("plan", help="plan.json from 'areal-flow compile --plan'")
    p.add_argument("-o", "--output", default="placement.html", help="output .html, .svg, .png or .dot")
    p.set_defaults(func=_cmd_viz)
    p = sub.add_parser("simulate", help="discrete-event simulation of a plan.json: step time, busy fractions, "
                                        "bubbles, async/sync ratio")
    p.add_argument("plan", help="plan.json from 'areal-flow compile --plan'")
    p.add_argument("--steps", type=int, default=8, help="train steps to simulate (default 8; the first quarter is warm-up)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled response lengths")
    p.add_argument("--k", type=int, help="staleness bound to compare with k=0 (default: the plan's)")
    p.add_argument("--trace", help="also write every span (node, worker, start, end) as JSON here")
    p.set_defaults(func=_cmd_simulate)
    p = sub.add_parser("eval", help="greedy accuracy and pass@k on a task's test set: of the model a graph's run "
                       "starts from, or of a model under a config", description=EVAL_DOC)
    p.add_argument("model", help="a graph file (graphs/*.py: the model its run starts from, on its dataset), or a "
                   "preset (tiny-arith, smollm2-135m), a transformers folder (runs/<name>/model) or a .gguf")
    p.add_argument("--task", help="test set and rule by dataset.name: arithmetic, gsm8k, longtail or reasoning_gym:<dataset> (default: the "
                   "config's dataset.name; a graph's is its own)")
    p.add_argument("--flow", help="which @flow, when the graph file holds several")
    p.add_argument("--n", type=_at_least(1), help="test problems (default: the config's eval.n_test, 500)")
    p.add_argument("--samples", type=_at_least(0), default=0,
                   help="k: samples per problem for pass@1..pass@k (default 0: greedy only)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the pass@k samples")
    p.add_argument("--out", help="also write the JSON result here")
    p.add_argument("--config", help="YAML config of the run to match: seed, model.dtype, warm_start, dataset.* "
                   "(default: the .yaml beside a graph file; for runs/<name>/model, runs/<name>/config.yaml; for "
                   "another model, none: the defaults, as a run without one)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, as the run's, e.g. seed=2 "
                   "dataset.max_digits=3")
    p.set_defaults(func=_cmd_eval)
    p = sub.add_parser("config", help="list every config key (type, default, meaning) and the aliases; "
                                      "with a YAML file or overrides, print the resolved config")
    p.add_argument("file", nargs="?", help="YAML config to resolve (optional)")
    p.add_argument("overrides", nargs="*", help="dotted overrides to resolve, e.g. training.seed=3")
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser("timeline", help="a run's busy/idle per node, waits per edge, staleness; draws timeline.html")
    p.add_argument("run", help="run folder (runs/<name>) with trace.json or trace/")
    p.add_argument("-o", "--output", help="HTML path (default <run>/timeline.html)")
    p.add_argument("--simulate", action="store_true", help="also print the compiler's simulation of the plan, "
                   "calibrated on this run's trace, beside the measured busy/idle per node (runtime.calibrate)")
    p.set_defaults(func=_cmd_timeline)
    p = sub.add_parser("replay", help="re-run the nodes after a recorded edge (debug.record) and compare the weights "
                                      "bit for bit with the run's; exit 1 when they differ")
    p.add_argument("run", help="run folder (runs/<name>) with plan.json and record/")
    p.add_argument("--from", dest="edge", required=True, help="the recorded edge, e.g. advantage->train_step")
    p.add_argument("--until", type=int, help="last step to replay (default: all recorded steps)")
    p.set_defaults(func=_cmd_replay)
    return parser


def _guarded(fn, args) -> int:
    from areal_flow.config import ConfigError
    from areal_flow.graph import GraphError
    from compiler.allocation import AllocationError
    from areal_flow.config_compile import CompileConfigError
    from compiler.errors import InfeasiblePlanError
    from compiler.models import ModelSpecError
    from compiler.plan import PlanSchemaError
    from compiler.strategy import StrategyError

    user_errors = (CLIError, ConfigError, GraphError, AllocationError, CompileConfigError, InfeasiblePlanError,
                   ModelSpecError, PlanSchemaError, StrategyError)
    try:
        code = fn(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return code
    except user_errors as exc:
        print(f"areal-flow: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `areal-flow config | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        print("areal-flow: error: output pipe closed before all output was written", file=sys.stderr)
        return 2
    except Exception as exc:
        # Only a run imports the runtime (torch); a worker can have failed only if it did.
        checkpoint = sys.modules.get("runtime.checkpoint")
        hf = sys.modules.get("areal_flow.models.hf")  # loaded only where a model's weights were looked up
        if (checkpoint is not None and isinstance(exc, checkpoint.ResumeError)) or \
                (hf is not None and isinstance(exc, hf.WeightsNotInstalled)):  # a user error of a run
            print(f"areal-flow: error: {exc}", file=sys.stderr)
            return 2
        restarts = sys.modules.get("runtime.restarts")  # where the driver's WorkerFailed lives
        if restarts is None or not isinstance(exc, restarts.WorkerFailed):
            raise
        # The worker's own traceback is in the message; ours adds nothing.
        print(f"areal-flow: a worker failed; outputs written so far are kept\n{exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM / SIGHUP during a run (runtime.lifecycle.Stopped)
        signum = getattr(stop, "signum", 2)
        print("areal-flow: interrupted; outputs written so far are kept", file=sys.stderr)
        return 128 + signum


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops filling `overrides` at the first option (`run g.py --config c.yaml k=v`):
    # the key=value words after it come back as extras and are overrides too.
    if extra and (not hasattr(args, "overrides") or any(a.startswith("-") for a in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return _guarded(args.func, args)


def run_main(flow: Flow, argv: list[str] | None = None) -> int:
    """``python graphs/x.py [--config Y] [key=value ...]``: the same as ``areal-flow run``."""
    parser = argparse.ArgumentParser(prog=Path(flow.source_file).name, description=f"run the '{flow.name}' graph")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.lr=1e-4")
    parser.add_argument("--config", help="YAML config (default: the .yaml beside this file)")
    args = parser.parse_args(argv)
    from areal_flow.cli.run import run_flow

    return _guarded(lambda a: run_flow(flow, flow_config(flow, a), a.config), args)

