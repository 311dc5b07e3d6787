"""The commands that read a finished model or run folder: ``eval``, ``timeline`` and ``replay``.

Owns their argument checks and one-line errors; the work is the runtime's
(``runtime.evaluate``, ``runtime.timeline``, ``runtime.calibrate``, ``runtime.replay``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from areal_flow.cli.common import CLIError, check_output_folder


def eval_command(args: argparse.Namespace) -> int:
    """``areal-flow eval``: greedy accuracy and pass@k, as JSON, of the model a graph's run starts
    from (a ``.py`` graph file: compiled with its config as ``run`` does,
    ``runtime.evaluate.start_of_run``) or of a model spec under ``--config`` on the task
    ``--task`` (default: the config's ``dataset.name``; ``eval_task``). Without ``--config``, a run's
    model folder (``runs/<name>/model``) is scored under that run's ``config.yaml``.

    Raises:
        CLIError: the ``--out`` folder is missing, ``--task`` differs from a graph's dataset, or the
            model/task cannot be loaded (first line of its error).
    """
    from runtime.evaluate import eval_task, evaluate_model, start_of_run

    check_output_folder(args.out)
    try:
        if args.model.endswith(".py"):  # a graph file: the model its run starts from
            from areal_flow.cli.common import flow_config, load_flow
            from compiler.program import compile_program

            flow = load_flow(args.model, args.flow)
            cfg = flow_config(flow, argparse.Namespace(config=args.config, overrides=args.overrides))
            if args.task is not None and args.task != cfg.dataset.name:
                raise CLIError(f"--task {args.task}: {args.model} trains on dataset.name={cfg.dataset.name!r}; leave "
                               "--task out (the graph's own is used)")
            plan = compile_program(flow(cfg), cfg)
            folder, task = start_of_run(plan)
            chat_template = next(n for n in plan.nodes if n.grain == "stream").attrs.get("chat_template")
        else:
            from areal_flow.config_load import load_config
            from areal_flow.models.names import resolve_name
            from runtime.model_source import prepare_initial_model

            config = args.config if args.config is not None else _run_config(args.model)
            try:
                cfg = load_config(config, args.overrides)
            except ValueError as exc:  # ConfigError too: an older run's keys, a bad override
                raise CLIError(f"{str(exc).splitlines()[0]} (--config FILE scores under another config)") from None
            cfg.dataset.name = args.task or cfg.dataset.name
            task = eval_task(cfg)
            cfg.model.path = args.model
            folder, chat_template = prepare_initial_model(cfg, task, progress=True), None
            if config is None:
                tiny = resolve_name(args.model).kind == "tiny"
                print(f"areal-flow eval: note: no --config: the defaults set the task (dataset.*) and the decoding "
                      f"(gen.*){f', and {args.model} is warm-started under them' if tiny else ''}; give the run's "
                      "config (--config runs/<name>/config.yaml) or a graph file (graphs/arith_grpo.py) to match "
                      "a run", file=sys.stderr)
        result = evaluate_model(folder, task, model=args.model, n=args.n or cfg.eval.n_test, samples=args.samples,
                                temperature=args.temperature, dtype=cfg.model.dtype, chat_template=chat_template)
    except (ValueError, FileNotFoundError, ModuleNotFoundError, OSError) as exc:
        raise CLIError(str(exc).splitlines()[0]) from None
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def _run_config(model: str) -> str | None:
    """The config of the run a model folder came from (``runs/<name>/model`` ->
    ``runs/<name>/config.yaml``, which every run writes beside its ``plan.json``), said on stderr;
    None for anything else."""
    run = Path(model).parent
    beside = run / "config.yaml"
    if not (Path(model).is_dir() and beside.is_file() and (run / "plan.json").is_file()):
        return None
    print(f"areal-flow eval: note: {model} is scored under its run's config, {beside} (--config picks another)",
          file=sys.stderr)
    return str(beside)


def _run_folder(path: str) -> Path:
    folder = Path(path)
    if not (folder / "plan.json").is_file():
        raise CLIError(f"{folder}: not a run folder (no plan.json); runs write runs/<name>/")
    return folder


def timeline_command(args: argparse.Namespace) -> int:
    """``areal-flow timeline``: busy/idle per node and waits per edge of a run folder, ``timeline.html``, and with
    ``--simulate`` the calibrated simulator's prediction beside the measurement.

    Raises:
        CLIError: not a run folder, no usable ``trace.json``, or the ``--output`` folder is missing.
    """
    from runtime.timeline import TimelineError, format_timeline, summarize, to_html

    folder = _run_folder(args.run)
    try:
        timeline = summarize(folder)
    except TimelineError as exc:
        raise CLIError(str(exc)) from None
    print(format_timeline(timeline))
    out = Path(args.output) if args.output else folder / "timeline.html"
    check_output_folder(str(out))
    out.write_text(to_html(folder, timeline))
    print(f"\ntimeline graph written to {out}; open {folder / 'trace.json'} in https://ui.perfetto.dev")
    if args.simulate:
        from runtime.calibrate import compare, format_comparison

        try:
            print("\n" + format_comparison(compare(folder)))
        except TimelineError as exc:
            raise CLIError(str(exc)) from None
    return 0


def replay_command(args: argparse.Namespace) -> int:
    """``areal-flow replay``: re-runs the nodes after a recorded edge; exit 0 when every step's weights are
    bit-identical, 1 otherwise.

    Raises:
        CLIError: not a run folder, or nothing recorded on that edge.
    """
    from runtime.record import RecordError
    from runtime.replay import format_report, replay

    folder = _run_folder(args.run)
    try:
        report = replay(folder, args.edge, until=args.until)
    except RecordError as exc:
        raise CLIError(str(exc)) from None
    print(format_report(report))
    return 0 if report.identical else 1
