"""The commands that read a finished model or run folder: ``eval``, ``timeline`` and ``replay``.

Owns their argument checks and one-line errors; the work is the runtime's
(``runtime.evaluate``, ``runtime.timeline``, ``runtime.calibrate``, ``runtime.replay``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from areal_flow.cli.common import CLIError, check_output_folder


def eval_command(args: argparse.Namespace) -> int:
    """``areal-flow eval``: greedy accuracy and pass@k of a model folder on a task's test set, as JSON.

    Raises:
        CLIError: the ``--out`` folder is missing, or the model/task cannot be loaded (first line of its error).
    """
    from areal_flow.config_load import load_config
    from runtime.evaluate import evaluate_model

    check_output_folder(args.out)
    cfg = load_config(args.config, args.overrides)
    max_digits = cfg.dataset.max_digits if args.config or any(o.startswith("dataset.max_digits=")
                                                               for o in args.overrides) else 2
    try:
        result = evaluate_model(args.model, args.task, n=args.n, samples=args.samples, temperature=args.temperature,
                                cfg=cfg, max_digits=max_digits)
    except (ValueError, FileNotFoundError, ModuleNotFoundError, OSError) as exc:
        raise CLIError(str(exc).splitlines()[0]) from None
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


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
