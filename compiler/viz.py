"""Drawing a plan: which graph node runs on which devices of which machine.

Owns the Graphviz DOT form of the placement
graph; the self-contained HTML page is ``compiler.viz_html``. The drawing shows the
graph's nodes with their data edges (and staleness bounds), the machines with their
device blocks coloured by the node running there, and the weight-sync routes with their
bytes and predicted seconds. Runs of machines with identical occupancy are drawn as one
box (``n1-63``) so a 1024-GPU plan stays readable in DOT.
"""

from __future__ import annotations


from compiler.plan import Plan

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f")
CPU_COLOR = "#d9d9d9"


def node_colors(plan: Plan) -> dict[str, str]:
    """Graph node -> fill colour: a palette colour per device node, grey for cpu nodes."""
    device = [n.name for n in plan.nodes if n.role != "cpu"]
    return {n.name: PALETTE[device.index(n.name) % len(PALETTE)] if n.role != "cpu" else CPU_COLOR for n in plan.nodes}


def occupancy(plan: Plan) -> dict[tuple[int, int], list[str]]:
    """``(machine, device)`` -> device nodes placed there, for every device of the cluster."""
    c = plan.cluster
    occupied: dict[tuple[int, int], list[str]] = {
        (m, d): [] for m in range(c["n_nodes"]) for d in range(c["n_gpus_per_node"])
    }
    for n in plan.nodes:
        if n.role != "cpu":
            for dev in n.mesh.devices():
                occupied[dev].append(n.name)
    return occupied


def machine_runs(plan: Plan) -> list[tuple[int, int, list[tuple[int, int, tuple[str, ...]]]]]:
    """Consecutive machines with identical occupancy: ``(first, last, blocks)`` where a block
    is ``(first_device, last_device, nodes)`` of devices sharing the same occupants."""
    occupied = occupancy(plan)
    per_node = plan.cluster["n_gpus_per_node"]
    runs: list = []
    for m in range(plan.cluster["n_nodes"]):
        blocks: list = []
        for d in range(per_node):
            who = tuple(occupied[(m, d)])
            if blocks and blocks[-1][2] == who:
                blocks[-1] = (blocks[-1][0], d, who)
            else:
                blocks.append((d, d, who))
        if runs and runs[-1][2] == blocks:
            runs[-1] = (runs[-1][0], m, blocks)
        else:
            runs.append((m, m, blocks))
    return runs


def _q(text: str) -> str:
    """A DOT quoted string; newlines become DOT line breaks."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _block_id(first: int, d0: int) -> str:
    return f"m{first}_d{d0}"


def to_dot(plan: Plan) -> str:
    """The placement graph in Graphviz DOT."""
    colors = node_colors(plan)
    gpu = plan.cluster["gpu"]
    out = [
        f"digraph {_q('plan ' + plan.id)} {{",
        "  rankdir=TB; compound=true; fontname=Helvetica;",
        "  node [fontname=Helvetica, style=filled, shape=box]; edge [fontname=Helvetica, fontsize=10];",
        f"  label={_q(f'{plan.graph}: {plan.allocation}  |  step {plan.step_time_s:.2f} s, idle {plan.idle_fraction:.0%}')};",
        "  subgraph cluster_graph { label=\"graph\"; style=dashed;",
    ]
    for n in plan.nodes:
        if n.role == "cpu":
            label = f"{n.name}\n{n.op} (cpu, with {n.placed_with})"
            out.append(f"    {_q(n.name)} [shape=ellipse, fillcolor={_q(colors[n.name])}, label={_q(label)}];")
        else:
            label = f"{n.name}\n{n.op} {n.strategy}\n{n.mesh.label()}\n{n.memory_bytes / 2**30:.1f} GiB/dev, {n.time_s:.2f} s"
            out.append(f"    {_q(n.name)} [fillcolor={_q(colors[n.name])}, fontcolor=white, label={_q(label)}];")
    out.append("  }")
    for e in plan.edges:
        style = "dashed" if e.kind == "weights" else "solid"
        label = f"k<={e.max_staleness}" if e.max_staleness is not None else ""
        out.append(f"  {_q(e.src)} -> {_q(e.dst)} [style={style}, label={_q(label)}];")
    block_of: dict[tuple[int, int], str] = {}
    for first, last, blocks in machine_runs(plan):
        name = f"n{first}" if first == last else f"n{first}-{last}"
        title = f"machine {name} ({plan.cluster['n_gpus_per_node']} x {gpu})"
        out.append(f"  subgraph cluster_m{first} {{ label={_q(title)};")
        for d0, d1, who in blocks:
            bid = _block_id(first, d0)
            devs = f"g{d0}" if d0 == d1 else f"g{d0}-{d1}"
            fill = colors[who[0]] if who else "#ffffff"
            label = f"{devs}\n{' | '.join(who) if who else 'idle'}"
            out.append(f"    {bid} [fillcolor={_q(fill)}, label={_q(label)}];")
            for m in range(first, last + 1):
                for d in range(d0, d1 + 1):
                    block_of[(m, d)] = bid
        out.append("  }")
    drawn = set()
    for n in plan.nodes:
        if n.role != "cpu":
            for dev in n.mesh.devices():
                if (n.name, block_of[dev]) not in drawn:
                    drawn.add((n.name, block_of[dev]))
                    out.append(f"  {_q(n.name)} -> {block_of[dev]} [style=dotted, arrowhead=none, color=gray];")
    for r in plan.routes:
        src = block_of[r.src_mesh.devices()[0]]
        dst = block_of[r.dst_mesh.devices()[0]]
        label = f"weight sync {r.bytes / r.replicas / 1e9:.2f} GB x {r.replicas}, {r.seconds:.2f} s ({r.link})"
        out.append(f"  {src} -> {dst} [color=red, penwidth=2, label={_q(label)}, fontcolor=red];")
    out.append("}")
    return "\n".join(out) + "\n"
