"""The plan as a terminal table: node, mesh, strategy, memory per device and its headroom,
predicted time; then the step, its bottleneck, the margin over the runner-up, warnings and
every assumption used (``compiler.explain``).

Owns :func:`format_table`, the text ``areal-flow compile --plan`` prints (its numbers are
checked against a hand derivation in ``tests/test_compiler_outputs.py``). Memory in GiB
(2^30 bytes), data in GB (10^9 bytes), time in seconds.
"""

from __future__ import annotations

from compiler.explain import assumptions, bottleneck, headroom, memory_line, runner_up
from compiler.hardware import GIB
from compiler.plan import Plan

_SHORT = {"weights": "w", "gradients": "g", "optimizer": "opt", "activations": "act", "kv_cache": "kv"}


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _memory(node) -> str:
    if not node.memory:
        return "-"
    parts = " ".join(f"{_SHORT[k]} {v / GIB:.1f}" for k, v in node.memory.items() if v)
    return f"{node.memory_bytes / GIB:.1f} GiB ({parts})"


def _time(node) -> str:
    if not node.times:
        return "-"
    parts = " ".join(f"{k} {v:.2f}" for k, v in node.times.items() if v >= 0.005)
    return f"{node.time_s:.2f} s ({parts})"


def format_table(plan: Plan) -> str:
    """Readable summary of ``plan``: header, one row per graph node, weight syncs, step
    time with its breakdown, idle fraction, allocation string and alternatives."""
    c, d = plan.cluster, plan.device
    capacity = d["memory_bytes"] / GIB
    lines = [
        f"plan {plan.id}  graph '{plan.graph}'  {c['n_nodes']} x {c['n_gpus_per_node']} {c['gpu']} "
        f"({capacity:.1f} GiB each)  mode {plan.mode} (max staleness {plan.staleness_bound})"
        + (f"; the predictions below assumed k={plan.max_staleness}" if plan.staleness_bound != plan.max_staleness
           else ""),
        f"allocation: {plan.allocation}",
        "",
    ]
    header = ("node", "op", "role", "mesh", "strategy", "memory/device", "headroom", "time/step")
    rows = []
    for n in plan.nodes:
        if n.role == "cpu":
            where, strategy = f"with {n.placed_with}", "-"
        else:
            where = n.mesh.label()
            strategy = n.strategy + (f" m{n.micro_batches}" if n.micro_batches else "")
            strategy += f" c{n.concurrent}" if n.concurrent else ""
            strategy += " ac" if n.activation_checkpointing else ""
        rows.append((n.name, n.op, n.role, where, strategy, _memory(n), headroom(plan, n), _time(n)))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header) - 1)]
    for row in [header] + rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    lines.append("")
    for r in plan.routes:
        lines.append(
            f"weight sync {r.src} ({r.src_mesh.label()}) -> {r.dst} ({r.dst_mesh.label()}): "
            f"{_bytes(r.bytes / r.replicas)} to each of {r.replicas} replica(s) over the {r.link} link, "
            f"{r.seconds:.2f} s"
        )
    how = "max(gen, train) + sync" if plan.overlapped else "gen + train + sync"
    lines.append(
        f"step time {plan.step_time_s:.2f} s = {how} (gen {plan.generation_s:.2f} s, train {plan.training_s:.2f} s, "
        f"sync {plan.sync_s:.2f} s); {'colocated' if plan.colocated else 'disaggregated'}; "
        f"idle {plan.idle_fraction:.1%} of device time"
    )
    lines.append(f"bottleneck: {bottleneck(plan)}")
    why = runner_up(plan)
    if why:
        lines.append(f"why this allocation: {why}")
    if len(plan.alternatives) > 1:
        lines.append("alternatives (this plan's allocation first, then the search's by step time):")
        for i, alt in enumerate(plan.alternatives, 1):
            lines.append(f"  {i}. {alt.step_time_s:8.2f} s  idle {alt.idle_fraction:6.1%}  {alt.allocation}")
    lines.extend(f"WARNING: {w}" for w in plan.warnings)
    lines.append(memory_line(plan))
    lines.extend(f"assumed: {a}" for a in assumptions(plan))
    lines.append("m = micro-batches per DP rank, c = sequences decoded at once per replica, ac = activation "
                 "checkpointing on; cpu nodes run on their host's machine")
    return "\n".join(lines)
