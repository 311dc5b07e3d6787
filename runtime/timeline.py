"""What a run's timeline says: busy fraction per node, waits per edge, staleness per edge.

Owns ``areal-flow timeline runs/<name>``: it reads ``trace.json`` (``runtime.trace``; merged
from ``trace/*.jsonl`` when the run died before merging), ``plan.json`` and
``trajectories/trajectories.jsonl``, and reports

* per graph node: busy time (the sum of its spans, microseconds) over ``instances x wall``,
  where ``instances`` is the number of workers that ran it (generation replicas) and
  ``wall`` the sum over the run's attempts (a resumed or restarted run has several,
  :func:`split_attempts`) of each attempt's first start to last end, so the time between
  an interrupted attempt and its resume is left out; idle = 1 - busy;
* per node with phase spans (a train_step's ``forward``/``backward``/``optimizer``,
  ``runtime.train_phases``): count, total seconds and mean ms per phase, and the phases'
  share of the node's busy time (they nest in its spans, so they do not add to busy);
* per edge and kind of wait (``channel``, ``admission``, ``batch``): count, mean and max (ms);
* per bounded-staleness edge (the data edge into a train_step): the histogram of token
  staleness ``step - version`` over policy tokens (multi-turn env tokens, ``loss_mask`` 0 or
  version -1, are left out);

and draws the plan's graph (``compiler.viz_html``'s drawing) with nodes coloured by busy
fraction and data edges labelled with their mean wait. It must not run anything.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from compiler.plan import Plan
from runtime.trace import ATTEMPT, TRACE_FILE, merge_trace


class TimelineError(ValueError):
    """The run folder lacks what the timeline needs (names the file)."""


@dataclass
class NodeUse:
    busy_us: int
    instances: int
    fraction: float


@dataclass
class PhaseUse:
    """Spans of one phase of a node: ``count``, ``total_s`` (seconds), ``mean_ms``."""

    count: int
    total_s: float
    mean_ms: float


@dataclass
class EdgeWait:
    count: int
    mean_ms: float
    max_ms: float


@dataclass
class Timeline:
    """Attributes: wall_s (seconds), nodes (by name), waits (by (edge, kind)), staleness
    (edge -> {versions: tokens}), phases ((node, phase) -> :class:`PhaseUse`), attempts (the
    policy version each attempt started from: ``[0]`` for a run never resumed)."""

    wall_s: float
    nodes: dict[str, NodeUse]
    waits: dict[tuple[str, str], EdgeWait]
    staleness: dict[str, dict[int, int]] = field(default_factory=dict)
    phases: dict[tuple[str, str], PhaseUse] = field(default_factory=dict)
    attempts: list[int] = field(default_factory=lambda: [0])


def load_events(run_dir: Path) -> list[dict]:
    """The complete (``ph: X``) events of ``<run_dir>/trace.json``, merged first if missing.

    Raises:
        TimelineError: no trace.json and no trace/ folder.
    """
    path = Path(run_dir) / TRACE_FILE
    if not path.is_file() and merge_trace(run_dir) is None:
        raise TimelineError(f"{run_dir}: no {TRACE_FILE} and no trace/ folder (was logging.trace=false?)")
    return [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]


def split_attempts(events: list[dict]) -> list[tuple[int, list[dict]]]:
    """The run's attempts, in order: ``(from_version, spans)`` per attempt. An ``attempt``
    span (``runtime.trace.mark_attempt``) starts a new one; spans before the first marker
    belong to an attempt from version 0 (left out when there are none: a hand-made or
    truncated trace). The markers themselves are not in ``spans``."""
    attempts: list[tuple[int, list[dict]]] = [(0, [])]
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["name"] == ATTEMPT and e["cat"] == "run":
            attempts.append((int(e["args"].get("from_version", 0)), []))
        else:
            attempts[-1][1].append(e)
    return attempts[1:] if not attempts[0][1] and len(attempts) > 1 else attempts


def load_plan(run_dir: Path) -> Plan:
    """The run's ``plan.json``. Raises TimelineError when there is none."""
    path = Path(run_dir) / "plan.json"
    if not path.is_file():
        raise TimelineError(f"{run_dir}: no plan.json (not a run folder?)")
    return Plan.from_json(path.read_text(), source=str(path))


def token_staleness(trajectories: Path) -> dict[int, int]:
    """``{step - version: tokens}`` over the policy tokens of every trained trajectory."""
    hist: Counter = Counter()
    if not trajectories.is_file():
        return {}
    for line in trajectories.read_text().splitlines():
        t = json.loads(line)
        mask = t.get("loss_mask") or [1] * len(t["versions"])
        hist.update(t["step"] - v for v, m in zip(t["versions"], mask) if m and v >= 0)
    return dict(sorted(hist.items()))


def summarize(run_dir: Path | str) -> Timeline:
    """The :class:`Timeline` of a run folder (module doc).

    Raises:
        TimelineError: no trace, or no ``plan.json``.
    """
    run_dir = Path(run_dir)
    plan = load_plan(run_dir)
    attempts = [(v, spans) for v, spans in split_attempts(load_events(run_dir)) if spans]
    if not attempts:
        raise TimelineError(f"{run_dir / TRACE_FILE}: holds no spans")
    wall_us = sum(max(e["ts"] + e["dur"] for e in s) - min(e["ts"] for e in s) for _, s in attempts)
    events = [e for _, spans in attempts for e in spans]
    busy: dict[str, int] = defaultdict(int)
    workers: dict[str, set] = defaultdict(set)
    waits: dict[tuple[str, str], list[int]] = defaultdict(list)
    phases: dict[tuple[str, str], list[int]] = defaultdict(list)
    for e in events:
        if e["cat"] == "edge":
            waits[(e["name"], e["args"].get("wait", ""))].append(e["dur"])
        elif e["cat"] == "phase":
            phases[(e["name"], e["args"].get("phase", ""))].append(e["dur"])
        else:
            busy[e["name"]] += e["dur"]
            workers[e["name"]].add(e["pid"])
    nodes = {n.name: NodeUse(busy.get(n.name, 0), len(workers.get(n.name, ())),
                             busy.get(n.name, 0) / max(1, len(workers.get(n.name, ())) * wall_us))
             for n in plan.nodes if n.name in busy}
    edge_waits = {key: EdgeWait(len(d), sum(d) / len(d) / 1000, max(d) / 1000) for key, d in sorted(waits.items())}
    bounded = [f"{e.src}->{e.dst}" for e in plan.edges if e.max_staleness is not None]
    hist = token_staleness(run_dir / "trajectories" / "trajectories.jsonl")
    phase_use = {key: PhaseUse(len(d), sum(d) / 1e6, sum(d) / len(d) / 1000) for key, d in phases.items()}
    return Timeline(wall_us / 1e6, nodes, edge_waits, {bounded[0]: hist} if bounded and hist else {}, phase_use,
                    [v for v, _ in attempts])


def format_timeline(t: Timeline) -> str:
    """The report printed by ``areal-flow timeline``."""
    resumed = (f" ({len(t.attempts)} attempts, from versions {', '.join(map(str, t.attempts))}; the time "
               "between them left out)") if len(t.attempts) > 1 else ""
    lines = [f"timeline over {t.wall_s:.2f} s{resumed}", "", "node            busy    idle   instances  busy s"]
    for name, u in t.nodes.items():
        lines.append(f"{name:14s} {u.fraction:6.1%}  {1 - u.fraction:6.1%}  {u.instances:9d}  {u.busy_us / 1e6:6.2f}")
    if t.phases:
        lines += ["", "phase                      count   total s   mean ms  of node busy"]
    for (name, phase), p in t.phases.items():
        share = p.total_s * 1e6 / t.nodes[name].busy_us if name in t.nodes and t.nodes[name].busy_us else 0.0
        lines.append(f"{name + ' ' + phase:25s} {p.count:6d}  {p.total_s:8.2f}  {p.mean_ms:8.2f}  {share:12.1%}")
    lines += ["", "edge                        wait       count   mean ms    max ms"]
    for (edge, kind), w in t.waits.items():
        lines.append(f"{edge:27s} {kind:9s} {w.count:6d}  {w.mean_ms:8.2f}  {w.max_ms:8.2f}")
    for edge, hist in t.staleness.items():
        total = sum(hist.values()) or 1
        lines += ["", f"token staleness on {edge} (versions: policy tokens)"]
        lines += [f"  {k}: {n:8d}  {'#' * max(1, round(40 * n / total))}" for k, n in hist.items()]
    return "\n".join(lines)


def busy_color(fraction: float) -> str:
    """White (idle) to dark red (always busy), linear in each RGB channel."""
    f = min(max(fraction, 0.0), 1.0)
    low, high = (255, 255, 255), (165, 15, 21)
    return "#" + "".join(f"{round(a + (b - a) * f):02x}" for a, b in zip(low, high))


def to_html(run_dir: Path | str, t: Timeline) -> str:
    """A self-contained page: the plan's graph coloured by busy fraction, edges labelled with
    their mean channel wait, and the report as text."""
    from compiler.viz_html import graph_page

    run_dir = Path(run_dir)
    plan = load_plan(run_dir)
    colors = {n.name: busy_color(t.nodes[n.name].fraction) if n.name in t.nodes else "#f0f0f0" for n in plan.nodes}
    lines = {n.name: [f"{n.name} ({n.op})", f"busy {t.nodes[n.name].fraction:.1%}" if n.name in t.nodes else "no spans",
                      f"{t.nodes[n.name].instances} worker(s)" if n.name in t.nodes else ""] for n in plan.nodes}
    labels = {}
    for (edge, kind), w in t.waits.items():
        labels.setdefault(edge, []).append(f"{kind} {w.mean_ms:.1f} ms")
    ink = {n: ("#fff" if t.nodes[n].fraction > 0.5 else "#222") for n in t.nodes}
    return graph_page(f"timeline of {run_dir.name}", plan, colors, lines, {e: ", ".join(v) for e, v in labels.items()},
                      ink, f"<pre>{escape(format_timeline(t))}</pre>")
