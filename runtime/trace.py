"""The run's timeline: per-worker span recorders and the merged Chrome/Perfetto trace.

Owns what a span is on disk and how the driver merges the workers' spans into
``runs/<name>/trace.json`` (Trace Event Format: ``{"traceEvents": [...]}``, complete events
``ph: "X"``, open it in https://ui.perfetto.dev or ``chrome://tracing``). It must not decide
what is timed: the workers (``runtime.workers``) and the router (``runtime.router``) do.

Each worker appends its spans to ``runs/<name>/trace/<worker>.jsonl`` (one JSON object a
line: ``name``, ``cat``, ``ts``, ``dur``, ``proc``, ``track``, ``args``), buffered and flushed
every :data:`FLUSH_EVENTS` spans or :data:`FLUSH_S` seconds and on close, so a crashed
worker loses at most that much. The files are appended to, never emptied: a new run starts
in an empty folder (``runtime.run_dir``), and a resumed run, or one whose workers were
restarted from a checkpoint, keeps the earlier attempts' spans; each such attempt starts
with a zero-length ``attempt`` span (category ``run``, ``args.from_version``) on the
driver's ``attempts`` track (:func:`mark_attempt`). :func:`merge_trace` turns the files into ``trace.json``:
one ``pid`` per ``proc`` (a worker such as ``generation/0``, or an edge such as
``edge reward->advantage``) and one ``tid`` per ``track`` in it, named by metadata events.

Span names: a graph node's name for its work (``generate`` engine steps, ``reward`` per
group, ``advantage``/``train_step`` per step, ``sync_weights`` publish/receive/load), the
phases of a train step under its node's name (category ``phase``, ``args.phase`` =
``forward``/``backward``/``optimizer``, ``runtime.train_phases``, nested in the step's span),
``checkpoint`` (category ``io``) for a checkpoint's write after its step, an
edge's name ``src->dst`` (category ``edge``) for time spent waiting on it: a group in a
channel (``args.wait = "channel"``, from the sender's send to the receiver's receive), the
router blocked on admission (``"admission"``), the trainer waiting for its batch (``"batch"``).

Clock: ``time.time_ns() // 1000``, microseconds since the Unix epoch. It is the one clock
that every process of a machine reads alike (``perf_counter`` and ``monotonic`` have a
per-process or per-boot origin), so spans of different workers line up; across machines
(Ray on several nodes) they line up only as well as the machines' clocks agree (NTP:
about a millisecond). A wall-clock step (NTP slew) during a run distorts the spans around it.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

TRACE_DIR = "trace"
TRACE_FILE = "trace.json"
FLUSH_EVENTS = 512
FLUSH_S = 1.0
ATTEMPT = "attempt"
"""Name of the span that marks where a resumed or restarted attempt starts (module doc)."""


def now_us() -> int:
    """Microseconds since the Unix epoch (module doc: why this clock)."""
    return time.time_ns() // 1000


def worker_file(run_dir: Path, worker: str) -> Path:
    """``<run_dir>/trace/<worker>.jsonl`` (``/`` in a worker name becomes ``-``)."""
    return Path(run_dir) / TRACE_DIR / f"{worker.replace('/', '-')}.jsonl"


class TraceRecorder:
    """Spans of one worker, appended to its JSONL file (module doc).

    Args:
        run_dir: the run folder; None records nothing (``logging.trace=false``): every
            method is then a no-op costing one attribute test.
        worker: the worker's name (``generation/0``, ``train_step/0``, ``driver``), the
            default ``proc`` of its spans.
    """

    def __init__(self, run_dir: Path | str | None, worker: str) -> None:
        self.worker = worker
        self.enabled = run_dir is not None
        self._events: list[str] = []
        self._flushed = time.monotonic()
        self._path = worker_file(Path(run_dir), worker) if self.enabled else None
        if self.enabled:
            self._path.parent.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_plan(cls, plan, run_dir: Path | str, worker: str) -> "TraceRecorder":
        """A recorder that records when the plan's ``logging.trace`` is on (the default)."""
        on = bool(plan.run.get("logging", {}).get("trace", True))
        return cls(run_dir if on else None, worker)

    def complete(self, name: str, track: str, start_us: int, end_us: int, cat: str = "node",
                 proc: str | None = None, **args) -> None:
        """Record a span ``[start_us, end_us]`` (microseconds, :func:`now_us`)."""
        if not self.enabled:
            return
        self._events.append(json.dumps({"name": name, "cat": cat, "ts": start_us, "dur": max(0, end_us - start_us),
                                        "proc": proc or self.worker, "track": track, "args": args}))
        if len(self._events) >= FLUSH_EVENTS or time.monotonic() - self._flushed > FLUSH_S:
            self.flush()

    @contextlib.contextmanager
    def span(self, name: str, track: str, cat: str = "node", **args):
        """Time the ``with`` body as one span (recorded also when the body raises)."""
        if not self.enabled:
            yield
            return
        start = now_us()
        try:
            yield
        finally:
            self.complete(name, track, start, now_us(), cat, **args)

    def flush(self) -> None:
        """Append the buffered spans to the worker's file."""
        if self._events:
            with self._path.open("a") as fh:
                fh.write("\n".join(self._events) + "\n")
            self._events.clear()
        self._flushed = time.monotonic()

    def close(self) -> None:
        if self.enabled:
            self.flush()


def mark_attempt(run_dir: Path | str, version: int, now: int | None = None) -> bool:
    """Append the ``attempt`` span of an attempt that continues from policy ``version`` to
    ``<run_dir>/trace/driver.jsonl`` (module doc), at ``now`` (microseconds, default
    :func:`now_us`). Nothing is written when the run has no ``trace/`` folder
    (``logging.trace=false``); returns whether it was written."""
    if not (Path(run_dir) / TRACE_DIR).is_dir():
        return False
    recorder = TraceRecorder(run_dir, "driver")
    ts = now_us() if now is None else now
    recorder.complete(ATTEMPT, "attempts", ts, ts, cat="run", from_version=version)
    recorder.close()
    return True


def read_spans(run_dir: Path) -> list[dict]:
    """Every span of ``<run_dir>/trace/*.jsonl``; a torn last line (a killed worker) is skipped."""
    spans = []
    for path in sorted((Path(run_dir) / TRACE_DIR).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return spans


def merge_trace(run_dir: Path | str) -> Path | None:
    """Merge the workers' span files into ``<run_dir>/trace.json``; None when there are none.

    ``pid``: one per ``proc``, the driver first, then workers, then edges (by name);
    ``tid``: one per ``track`` of a proc, by name. Events are sorted by ``ts``, a longer span
    first at equal ``ts`` (an enclosing span before the spans nested in it).
    """
    run_dir = Path(run_dir)
    if not (run_dir / TRACE_DIR).is_dir():
        return None
    spans = read_spans(run_dir)
    procs = sorted({s["proc"] for s in spans}, key=lambda p: (p != "driver", p.startswith("edge "), p))
    pids = {p: i + 1 for i, p in enumerate(procs)}
    tracks = sorted({(s["proc"], s["track"]) for s in spans})
    tids = {key: i + 1 for i, key in enumerate(tracks)}
    events: list[dict] = []
    for proc, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": proc}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    for (proc, track), tid in tids.items():
        events.append({"ph": "M", "name": "thread_name", "pid": pids[proc], "tid": tid, "args": {"name": track}})
    for s in sorted(spans, key=lambda s: (s["ts"], -s["dur"])):
        events.append({"ph": "X", "name": s["name"], "cat": s["cat"], "ts": s["ts"], "dur": s["dur"],
                       "pid": pids[s["proc"]], "tid": tids[(s["proc"], s["track"])], "args": s["args"]})
    path = run_dir / TRACE_FILE
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def channel_edge(plan, receiver_nodes: list[str], sender_nodes: list[str]) -> str:
    """The name ``src->dst`` of the channel from one worker group to another: of the edges
    from ``sender_nodes`` into ``receiver_nodes``, the one from the sender's last node (plan
    order) to its first reader.

    Raises:
        ValueError: no edge joins the two groups (names both).
    """
    order = {n.name: i for i, n in enumerate(plan.nodes)}
    edges = [(src, n.name) for n in plan.nodes if n.name in receiver_nodes
             for src, _ in n.inputs.values() if src in sender_nodes]
    if not edges:
        raise ValueError(f"no data edge from {sender_nodes} into {receiver_nodes}")
    return "{}->{}".format(*min(edges, key=lambda e: (-order[e[0]], order[e[1]])))
