"""Replaying a recorded edge: the trainer's downstream nodes re-run on what crossed it.

Owns ``areal-flow replay <run> --from src->dst``: it reads the run's ``plan.json`` and the
edge's record (``runtime.record``: meta, ``step_<n>.pt``, ``digests.jsonl``), builds the
trainer's executors from ``dst`` on — from the version-0 weights, with the run's seed and
torch threads, exactly as the trainer built them — feeds them each recorded step in
order, without generation, and compares the digest of every train_step's weights after
each step with the run's. Bit-identical digests mean the step is deterministic given its
input, so a loss spike can be studied offline (docs/DEBUGGING.md). It must not generate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.record import RecordError, edge_folder, parse_edge, state_digest, step_of


@dataclass
class StepCheck:
    """One train_step node after one replayed step: the run's and the replay's digests and
    the replay's stats (``loss``, ``grad_norm``, ...)."""

    step: int
    node: str
    recorded: str
    replayed: str
    stats: dict = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return self.recorded == self.replayed


@dataclass
class ReplayReport:
    edge: str
    checks: list[StepCheck]

    @property
    def identical(self) -> bool:
        return bool(self.checks) and all(c.identical for c in self.checks)

    def first_divergence(self) -> StepCheck | None:
        return next((c for c in self.checks if not c.identical), None)


def _load_record(folder: Path, edge: str) -> tuple[dict, dict[tuple[int, str], str], list[Path]]:
    if not (folder / "meta.json").is_file():
        raise RecordError(f"no record of edge {edge!r} under {folder.parent}: run with debug.record=[{edge}]")
    meta = json.loads((folder / "meta.json").read_text())
    digests = {}
    if (folder / "digests.jsonl").is_file():
        for line in (folder / "digests.jsonl").read_text().splitlines():
            d = json.loads(line)
            digests[(d["step"], d["node"])] = d["digest"]
    steps = sorted(folder.glob("step_*.pt"), key=step_of)
    return meta, digests, steps


def replay(run_dir: Path | str, edge: str, until: int | None = None) -> ReplayReport:
    """Re-run the nodes from ``dst`` of ``edge`` on the run's record (module doc).

    Args:
        run_dir: the run folder (``plan.json``, ``record/``).
        edge: ``"src->dst"``, recorded by the run (``debug.record``).
        until: last step to replay (default: every recorded step).

    Raises:
        RecordError: no record of the edge, a step missing from it (names the steps; e.g.
            ``debug.record`` first set on a resume), a node downstream of ``dst`` reads a value that
            was not recorded (names it), or a multi-rank trainer (one process cannot
            reproduce its reduction order).
        FileNotFoundError: the run has no ``plan.json``.
    """
    from compiler.plan import Plan
    from runtime.topology import build_topology
    from runtime.workers import WorkerSpec, make_executor, worker_context

    run_dir = Path(run_dir)
    src, dst = parse_edge(edge)
    meta, digests, step_files = _load_record(edge_folder(run_dir, edge), edge)
    step_files = [p for p in step_files if until is None or step_of(p) <= until]
    recorded = {step_of(p) for p in step_files}
    lacking = [s for s in range(max(recorded, default=-1) + 1) if s not in recorded]
    if lacking:
        raise RecordError(f"replay of {edge!r}: the record lacks step(s) {', '.join(map(str, lacking))} of "
                          f"0..{max(recorded)}; replay starts from the initial weights and needs every step before "
                          "the last (record the edge from the run's start)")
    plan = Plan.from_json((run_dir / "plan.json").read_text(), source=str(run_dir / "plan.json"))
    group = next(g for g in build_topology(plan).groups.values() if dst in g.batch_nodes)
    if group.strategy.world_size > 1:
        raise RecordError(f"replay of {edge!r}: the trainer ran on {group.strategy.world_size} ranks; replay runs one "
                          "process and cannot reproduce their reduction order")
    spec = WorkerSpec(plan=plan, folders=meta["folders"], out_dir=str(run_dir), group=group.name, rank=0, inbox="",
                      control="", threads=int(meta["threads"]))
    ctx = worker_context(spec)
    batch = [ctx.node(n) for n in group.nodes if n in group.batch_nodes]
    nodes = batch[[n.name for n in batch].index(dst):]
    executors = {n.name: make_executor(n, ctx) for n in nodes}
    src_port = dict(nodes[0].inputs)[meta["port"]][1]
    checks = []
    for path in step_files:
        record = torch.load(path, weights_only=False)
        step = record["step"]
        values = {f"{src}.{src_port}": record["value"]}
        for node in nodes:
            missing = [f"{s}.{p}" for s, p in node.inputs.values() if f"{s}.{p}" not in values]
            if missing:
                raise RecordError(f"replay of {edge!r}: node '{node.name}' reads {missing}, which the record does not "
                                  f"hold; record an edge into '{node.name}' instead")
            inputs = {port: values[f"{s}.{p}"] for port, (s, p) in node.inputs.items()}
            result = executors[node.name].run(inputs, {"step": step, "publish": False, "indices": record["indices"]})
            values.update({f"{node.name}.{port}": v for port, v in result.items()})
            if node.trains:
                replayed = state_digest(executors[node.name].current_state())
                checks.append(StepCheck(step, node.name, digests.get((step, node.name), "missing"), replayed,
                                        {k: float(v) for k, v in result["stats"].metrics.items()
                                         if isinstance(v, (int, float))}))
    return ReplayReport(edge, checks)


def format_report(report: ReplayReport) -> str:
    """One line per (step, train_step): digests, identical or not, loss and grad norm."""
    lines = [f"replay of {report.edge}: {len({c.step for c in report.checks})} steps"]
    for c in report.checks:
        verdict = "identical" if c.identical else "DIFFERS"
        lines.append(f"  step {c.step:4d}  {c.node}: run {c.recorded}  replay {c.replayed}  {verdict}  "
                     f"loss {c.stats.get('loss', float('nan')):.6g}  grad_norm {c.stats.get('grad_norm', float('nan')):.4g}")
    first = report.first_divergence()
    if first is None and report.checks:
        lines.append("weights bit-identical to the run's after every step")
    elif first is not None:
        lines.append(f"first divergence: step {first.step}, node {first.node}")
    return "\n".join(lines)
