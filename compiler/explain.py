"""Why a plan is what it is: its bottleneck, memory headroom, the margin over the runner-up,
the warnings the compiler raises, and every assumption behind its numbers.

Owns the text both the terminal table (``compiler.table``) and the HTML page
(``compiler.viz_html``) show, computed from the plan alone, plus :func:`plan_warnings`,
which ``compiler.compile`` stores in the plan (it needs the search's results). It must
not cost or search anything.

- Bottleneck: when generation overlaps training (``overlapped``), the side that bounds
  ``max(G, T)`` and, on it, the node with the most seconds; otherwise the node with the
  most seconds of ``G + T``.
- Memory headroom: per device, usable = device memory x ``compile.memory_fraction`` (the
  rest is left for the CUDA context, NCCL buffers and allocator fragmentation; on CPU for
  the process itself).
- Runner-up: the two components of the step (each node's ``node.component`` seconds, the
  weight ``sync`` and the ``overlap`` hidden by asynchrony, :func:`component_times`) whose
  difference to the second allocation listed is largest.
"""

from __future__ import annotations

from compiler.hardware import GIB
from compiler.plan import Alternative, Plan

SLOWER_WARNING = 1.2  # warn when a manual allocation is predicted at least this much slower than the best found


def bottleneck(plan: Plan) -> str:
    """``"<node> (<seconds> s, <why>)"``; ``"-"`` when no node takes time."""
    device = [n for n in plan.nodes if n.times]
    if not device:
        return "-"
    if plan.overlapped:
        generation = plan.generation_s >= plan.training_s
        side = [n for n in device if (n.role == "generation") == generation]
        why = (f"{'generation' if generation else 'training'} bounds max(gen {plan.generation_s:.2f} s, "
               f"train {plan.training_s:.2f} s)")
    else:
        side, why = device, "the largest share of gen + train (they alternate)"
    node = max(side, key=lambda n: n.time_s)
    part = max(node.times, key=node.times.get)
    return f"{node.name} ({node.time_s:.2f} s, most in {part} {node.times[part]:.2f} s; {why})"


def usable_bytes(plan: Plan) -> float:
    """Device memory a plan may fill, bytes: memory x ``compile.memory_fraction`` (0.9 when
    the plan predates the field)."""
    return plan.device["memory_bytes"] * plan.workload.get("memory_fraction", 0.9)


def headroom(plan: Plan, node) -> str:
    """``"<free> of <usable> GiB free"`` for a device node, ``"-"`` for a cpu node."""
    if not node.memory:
        return "-"
    usable = usable_bytes(plan)
    return f"{(usable - node.memory_bytes) / GIB:.1f} of {usable / GIB:.1f} GiB free"


def memory_line(plan: Plan) -> str:
    """The usable memory per device and what the rest is for (on CPU: no CUDA, no NCCL)."""
    fraction = plan.workload.get("memory_fraction", 0.9)
    total = plan.device["memory_bytes"] / GIB
    rest = ("the rest for the CUDA context, NCCL buffers and allocator fragmentation" if plan.device_type == "cuda"
            else "the rest for the process itself and allocator fragmentation")
    what = "device" if plan.device_type == "cuda" else "worker process"
    return (f"memory per {what}: usable {total * fraction:.1f} of {total:.1f} GiB "
            f"(compile.memory_fraction={fraction}: {rest})")


def runner_up(plan: Plan) -> str | None:
    """Why the chosen allocation beats the second one: its margin and the two largest
    component differences (runner-up minus chosen); None with fewer than two."""
    if len(plan.alternatives) < 2 or not plan.alternatives[0].times or not plan.alternatives[1].times:
        return None
    best, other = plan.alternatives[0], plan.alternatives[1]
    diffs = _differences(best, other)
    parts = ", ".join(f"{key} {delta:+.2f} s" for key, delta in diffs[:2]) or "none (a tie broken by the serial time)"
    margin = other.step_time_s - best.step_time_s
    verb = "ties with" if round(margin, 2) == 0 else "beats" if margin > 0 else "is slower than"
    return (f"{verb} the next allocation '{other.allocation}' ({other.step_time_s:.2f} s, {margin:+.2f} s); "
            f"largest differences (next minus this): {parts}")


def _differences(best: Alternative, other: Alternative) -> list[tuple[str, float]]:
    keys = sorted(set(best.times) | set(other.times))
    diffs = [(k, other.times.get(k, 0.0) - best.times.get(k, 0.0)) for k in keys]
    return sorted((d for d in diffs if abs(d[1]) >= 0.005), key=lambda d: (-abs(d[1]), d[0]))


def assumptions(plan: Plan) -> list[str]:
    """Every modelling figure the predictions used, one per line."""
    d, w = plan.device, plan.workload
    eff = w.get("bandwidth_efficiency", 0.8)
    ld = w.get("length_dist", {})
    keys = {"fixed": ("mean",), "uniform": ("low", "high"), "lognormal": ("mean", "sigma")}.get(ld.get("kind"), ())
    shape = ", ".join(f"{k} {ld[k]}" for k in keys if k in ld)
    cuda = plan.device_type == "cuda"
    links = (f"HBM {d['hbm_bandwidth'] * eff / 1e9:.0f} GB/s, NVLink {d['intra_node_bandwidth'] * eff / 1e9:.0f} GB/s, "
             if cuda else f"memory {d['hbm_bandwidth'] * eff / 1e9:.0f} GB/s, between processes "
             f"{d['intra_node_bandwidth'] * eff / 1e9:.0f} GB/s, ")
    host = f"host {d['host_bandwidth'] * eff / 1e9:.0f} GB/s; " if cuda else ""
    return [
        f"device {d['name']}: peak {d['peak_flops'] / 1e12:.1f} TFLOP/s at MFU {w.get('mfu', 0.4)}; "
        f"bandwidths x {eff} efficiency: {links}network {d['inter_node_bandwidth'] * eff / 1e9:.0f} GB/s, "
        f"{host}{d['collective_latency_s'] * 1e6:.0f} us per collective"
        + ("" if cuda else "; one peak for every dtype, an assumed AVX2 core: a CPU with bf16 units (AMX) runs "
           "a bf16 engine several times faster (`areal-flow timeline <run> --simulate` calibrates on a run, "
           "docs/SIMULATE.md)"),
        f"responses: {ld.get('kind', '?')} length distribution ({shape}; fractions of the {w.get('new_tokens', '?')}-token "
        "budget); "
        f"{w.get('decode_step_overhead_s', 0) * 1e3:.1f} ms overhead per decode step; FSDP/DDP traffic "
        f"{w.get('fsdp_overlap', 0.0):.0%} hidden behind compute",
    ]


def plan_warnings(chosen, ranked, manual: bool, asked_async: bool, total_devices: int) -> tuple[str, ...]:
    """The compiler's warnings about the chosen candidate (``compiler.step.Candidate``).

    Args:
        ranked: the search's candidates, best first (may be empty when only a manual
            allocation fits).
        manual: ``chosen`` is the user's ``compile.allocation``.
        asked_async: the user or the graph asked for asynchronous training (k >= 1).
        total_devices: devices in the cluster.
    """
    found = []
    others = [c for c in ranked if c.allocation != chosen.allocation]
    if manual and others and chosen.step_time_s >= SLOWER_WARNING * others[0].step_time_s:
        found.append(f"the allocation given ('{chosen.allocation}', {chosen.step_time_s:.2f} s per step) is "
                     f"{chosen.step_time_s / others[0].step_time_s:.1f}x slower than the best found: "
                     f"'{others[0].allocation}' ({others[0].step_time_s:.2f} s)")
    used = sum(group[0].mesh.size for group in chosen.groups)
    if used < total_devices:
        found.append(f"{total_devices - used} of {total_devices} devices hold no node and stay idle")
    if asked_async and chosen.colocated:
        disaggregated = next((c for c in ranked if not c.colocated), None)
        alt = (f"; the best disaggregated allocation is '{disaggregated.allocation}' ({disaggregated.step_time_s:.2f} s)"
               if disaggregated else "; no disaggregated allocation fits")
        found.append("asynchronous training was asked (k >= 1), but generation and training share a mesh, so they "
                     f"alternate and do not overlap{alt}")
    return tuple(found)


def component_times(candidate) -> dict[str, float]:
    """What a candidate's step is made of, seconds: each node's ``node.component``, the
    weight ``sync``, and ``overlap``, minus what runs concurrently (``step - (G + T + S)``:
    ``-min(G, T)`` when generation overlaps training, else 0)."""
    times = {"sync": candidate.sync_s}
    for a in candidate.assignments():
        for key, value in a.cost.times.items():
            times[f"{a.task.node}.{key}"] = value
    times["overlap"] = candidate.step_time_s - (candidate.generation_s + candidate.training_s + candidate.sync_s)
    return times
