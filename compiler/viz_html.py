"""The placement graph as one self-contained HTML page (hand-drawn inline SVG, no network).

Owns :func:`to_html`. The page is well-formed XHTML (it parses as XML): a summary, the
graph (nodes by data depth, data edges with their staleness bound, weight edges dashed),
a list of what explains the plan (bottleneck, margin over the next allocation, memory
headroom, warnings, assumptions; ``compiler.explain``), the machines with one cell per
device coloured by the node(s) running on it, TP groups and pipeline stages outlined (each cell
has ``data-gpu="n<machine>:g<device>"`` and a tooltip), the weight-sync routes as red
arrows labelled with bytes and predicted seconds, and the plan table. Hovering a node,
a table row or a cell highlights everything of the same node (a few lines of inline JS).
:func:`graph_page` draws the same graph with other node colours and labels (the run's
timeline, ``runtime.timeline``).
"""

from __future__ import annotations

from html import escape

from compiler.explain import assumptions, bottleneck, headroom, memory_line, runner_up
from compiler.plan import Plan
from compiler.table import format_table
from compiler.viz import node_colors, occupancy

WIDTH = 1100
BOX_W, BOX_H, COL_GAP, ROW_GAP = 170, 58, 50, 24
CELL, CELL_GAP, PAD, TITLE_H = 20, 4, 10, 26
CHAR_W = 6.5
"""Upper bound of one character's width in px at the pages' 11 px sans-serif (Helvetica/Arial
average ~5.5-6.1): labels are laid out by it so that none is clipped or overlaps a box."""

_CSS = """
body { font-family: Helvetica, Arial, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; } h2 { font-size: 15px; margin-top: 22px; }
pre { background: #f6f6f6; padding: 8px; font-size: 11px; overflow-x: auto; }
table { border-collapse: collapse; font-size: 12px; }
td, th { border: 1px solid #ccc; padding: 3px 6px; text-align: left; }
svg text { font-size: 11px; }
.hl { stroke: #000 !important; stroke-width: 3px !important; }
tr.hl td { background: #ffe9a8; }
li.warn { color: #b00; }
"""

_JS = """
document.querySelectorAll('[data-node]').forEach(function (el) {
  var names = el.getAttribute('data-node').split(' ');
  function mark(on) {
    document.querySelectorAll('[data-node]').forEach(function (other) {
      var theirs = other.getAttribute('data-node').split(' ');
      if (theirs.some(function (n) { return names.indexOf(n) !== -1; })) {
        other.classList.toggle('hl', on);
      }
    });
  }
  el.addEventListener('mouseenter', function () { mark(true); });
  el.addEventListener('mouseleave', function () { mark(false); });
});
"""


def _attrs(**attrs) -> str:
    return "".join(f' {k.rstrip("_").replace("_", "-")}="{escape(str(v))}"' for k, v in attrs.items())


def _text(x: float, y: float, text: str, **attrs) -> str:
    return f"<text{_attrs(x=round(x, 1), y=round(y, 1), **attrs)}>{escape(text)}</text>"


def _depths(plan: Plan) -> dict[str, int]:
    """Longest path from a source over data edges (weight edges close the loop)."""
    depth = {n.name: 0 for n in plan.nodes}
    data = [e for e in plan.edges if e.kind != "weights"]
    for _ in plan.nodes:
        for e in data:
            depth[e.dst] = max(depth[e.dst], depth[e.src] + 1)
    return depth


def _graph_svg(plan: Plan, colors: dict[str, str], lines: dict[str, list[str]] | None = None,
               edge_labels: dict[str, str] | None = None, ink: dict[str, str] | None = None) -> str:
    """The graph: nodes by data depth, data edges (with their staleness bound and
    ``edge_labels["src->dst"]``), weight edges dashed. ``lines``: each node's text (default:
    name, placement, memory and time); ``ink``: its text colour (default by role)."""
    depth = _depths(plan)
    labels = {}
    for e in plan.edges:
        label = [f"staleness <= {e.max_staleness}"] if e.max_staleness is not None else []
        label += [edge_labels[f"{e.src}->{e.dst}"]] if edge_labels and f"{e.src}->{e.dst}" in edge_labels else []
        if label and e.kind != "weights":
            labels[(e.src, e.dst)] = "; ".join(label)
    gap = max([COL_GAP] + [CHAR_W * len(t) + 16 for t in labels.values()])  # every label fits between its boxes
    rows: dict[int, int] = {}
    pos = {}
    for n in plan.nodes:
        col = min(depth[n.name], len(plan.nodes))
        pos[n.name] = (20 + col * (BOX_W + gap), 30 + rows.get(col, 0) * (BOX_H + ROW_GAP))
        rows[col] = rows.get(col, 0) + 1
    height = max(y for _, y in pos.values()) + BOX_H + 70
    width = max(WIDTH, max(x for x, _ in pos.values()) + BOX_W + 20)
    parts = []
    for e in plan.edges:
        (x1, y1), (x2, y2) = pos[e.src], pos[e.dst]
        if e.kind == "weights":
            sx, sy, tx, ty = x1 + BOX_W / 2, y1 + BOX_H, x2 + BOX_W / 2, y2 + BOX_H
            low = max(sy, ty) + 45
            path = f"M{sx},{sy} C{sx},{low} {tx},{low} {tx},{ty}"
            parts.append(f'<path{_attrs(d=path, fill="none", stroke="#888", stroke_dasharray="5,4", marker_end="url(#arrow)")}/>')
            parts.append(_text((sx + tx) / 2, low - 8, "weights", text_anchor="middle", fill="#666"))
            continue
        sx, sy, tx, ty = x1 + BOX_W, y1 + BOX_H / 2, x2, y2 + BOX_H / 2
        parts.append(f'<line{_attrs(x1=sx, y1=sy, x2=tx, y2=ty, stroke="#555", marker_end="url(#arrow)")}/>')
        if (e.src, e.dst) in labels:
            parts.append(_text((sx + tx) / 2, (sy + ty) / 2 - 5, labels[(e.src, e.dst)], text_anchor="middle"))
    for n in plan.nodes:
        x, y = pos[n.name]
        fill = colors[n.name]
        text_color = (ink or {}).get(n.name) or ("#222" if n.role == "cpu" else "#fff")
        parts.append(f"<g{_attrs(data_node=n.name)}>")
        rx = 26 if n.role == "cpu" else 6
        parts.append(f'<rect{_attrs(x=x, y=y, width=BOX_W, height=BOX_H, rx=rx, fill=fill, stroke="#333")}/>')
        where = f"cpu, with {n.placed_with}" if n.role == "cpu" else f"{n.strategy} on {n.mesh.label()}"
        detail = "" if n.role == "cpu" else f"{n.memory_bytes / 2**30:.1f} GiB/dev, {n.time_s:.2f} s"
        for i, line in enumerate(lines[n.name] if lines else (f"{n.name} ({n.op})", where, detail)):
            parts.append(_text(x + 8, y + 16 + 15 * i, line, fill=text_color))
        parts.append("</g>")
    return _svg(width, height, parts)


def _svg(width: float, height: float, parts: list[str]) -> str:
    defs = (
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker>'
        '<marker id="sync" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#d62728"/></marker></defs>'
    )
    head = f'<svg xmlns="http://www.w3.org/2000/svg"{_attrs(width=round(width), height=round(height))}>'
    return head + defs + "".join(parts) + "</svg>"


def _machines_svg(plan: Plan, colors: dict[str, str]) -> str:
    n_nodes, per_node = plan.cluster["n_nodes"], plan.cluster["n_gpus_per_node"]
    box_w = 2 * PAD + per_node * (CELL + CELL_GAP) - CELL_GAP
    box_h = TITLE_H + CELL + PAD
    per_row = max(1, (WIDTH - 20) // (box_w + 14))
    occupied = occupancy(plan)
    origin = {}
    parts = []
    for m in range(n_nodes):
        x, y = 10 + (m % per_row) * (box_w + 14), 10 + (m // per_row) * (box_h + 14)
        origin[m] = (x, y)
        parts.append(f'<rect{_attrs(x=x, y=y, width=box_w, height=box_h, rx=5, fill="#fafafa", stroke="#999")}/>')
        parts.append(_text(x + PAD, y + 15, f"machine n{m} ({per_node} x {plan.cluster['gpu']})"))
        for d in range(per_node):
            who = occupied[(m, d)]
            cx, cy = x + PAD + d * (CELL + CELL_GAP), y + TITLE_H
            gpu = f"n{m}:g{d}"
            tip = f"{gpu}: {' | '.join(who) if who else 'idle'}"
            parts.append(f"<g{_attrs(data_gpu=gpu, data_node=' '.join(who) or 'idle')}><title>{escape(tip)}</title>")
            share = CELL / max(1, len(who))
            for i, name in enumerate(who or ["idle"]):
                fill = colors.get(name, "#ffffff")
                parts.append(f'<rect{_attrs(x=cx, y=cy + i * share, width=CELL, height=share, fill=fill, stroke="#666")}/>')
            parts.append("</g>")
    parts.extend(_group_outlines(plan, origin))
    rows = -(-n_nodes // per_row)
    bottom = 10 + rows * (box_h + 14)
    for i, r in enumerate(plan.routes):
        (sx, sy), (tx, ty) = origin[r.src_mesh.first_node], origin[r.dst_mesh.first_node]
        sx, sy = sx + PAD + (r.src_mesh.first_device + r.src_mesh.n_devices / 2) * (CELL + CELL_GAP), sy + box_h
        tx, ty = tx + PAD + (r.dst_mesh.first_device + r.dst_mesh.n_devices / 2) * (CELL + CELL_GAP), ty + box_h
        low = max(sy, ty) + 12  # inside the gap under the lower machine row: crosses no title
        path = f"M{sx:.1f},{sy:.1f} C{sx:.1f},{low:.1f} {tx:.1f},{low:.1f} {tx:.1f},{ty:.1f}"
        parts.append(f'<path{_attrs(d=path, fill="none", stroke="#d62728", stroke_width=2, marker_end="url(#sync)")}/>')
        label = (  # under the grid, one line a route: never over a machine
            f"weight sync {r.src} -> {r.dst}: {r.bytes / r.replicas / 1e9:.2f} GB x {r.replicas}, "
            f"{r.seconds:.2f} s over {r.link}"
        )
        parts.append(_text(10, bottom + 14 + 16 * i, label, fill="#d62728"))
    return _svg(WIDTH, bottom + 24 + 16 * len(plan.routes), parts)


def _group_outlines(plan: Plan, origin: dict[int, tuple[float, float]]) -> list[str]:
    """Outlines around each node's TP groups (solid) and, with pp > 1, its pipeline stages
    (dashed), per machine. Ranks follow ``runtime.parallel.mesh``: a mesh of shape
    (pp, dp, cp, tp) laid over the node's devices in order, so a TP group is ``tp``
    consecutive devices and a stage ``dp * cp * tp``."""
    parts = []
    for n in plan.nodes:
        s = n.parallel
        if s is None:
            continue
        devices = n.mesh.devices()
        for size, dash, inset in ((s.tp, None, 2), (s.world_size // s.pp, "4,3", 5)):
            if size == 1 or (dash and s.pp == 1):
                continue
            for start in range(0, len(devices), size):
                group = devices[start:start + size]
                for machine in sorted({m for m, _ in group}):
                    devs = [d for m, d in group if m == machine]
                    x, y = origin[machine]
                    x0 = x + PAD + min(devs) * (CELL + CELL_GAP) - inset
                    width = (max(devs) - min(devs) + 1) * (CELL + CELL_GAP) - CELL_GAP + 2 * inset
                    attrs = dict(x=x0, y=y + TITLE_H - inset, width=width, height=CELL + 2 * inset, fill="none",
                                 stroke="#111", stroke_width=1.5, data_node=n.name)
                    if dash:
                        attrs["stroke_dasharray"] = dash
                    parts.append(f"<rect{_attrs(**attrs)}/>")
    return parts


def _node_table(plan: Plan, colors: dict[str, str]) -> str:
    titles = ("node", "op", "role", "mesh", "strategy", "m (micro-batches)", "c (sequences at once)", "memory/device",
              "headroom", "time/step")
    head = "".join(f"<th>{h}</th>" for h in titles)
    rows = []
    for n in plan.nodes:
        mesh = f"with {n.placed_with}" if n.role == "cpu" else n.mesh.label()
        memory = "-" if not n.memory else f"{n.memory_bytes / 2**30:.1f} GiB"
        time = "-" if not n.times else f"{n.time_s:.2f} s"
        swatch = f'<span style="background:{colors[n.name]}">&#160;&#160;&#160;</span> '
        cells = (swatch + escape(n.name), n.op, n.role, mesh, n.strategy or "-", n.micro_batches or "-",
                 n.concurrent or "-", memory, headroom(plan, n), time)
        rows.append(f"<tr{_attrs(data_node=n.name)}>" + "".join(f"<td>{c if i == 0 else escape(str(c))}</td>" for i, c in enumerate(cells)) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def graph_page(title: str, plan: Plan, colors: dict[str, str], lines: dict[str, list[str]],
               edge_labels: dict[str, str], ink: dict[str, str], body: str) -> str:
    """A page with the plan's graph drawn as in :func:`to_html` (with the given node
    colours, text and edge labels; see ``_graph_svg``) above ``body`` (XHTML)."""
    return "".join([
        '<!DOCTYPE html>\n<html xmlns="http://www.w3.org/1999/xhtml" lang="en"><head><meta charset="utf-8"/>',
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>", _graph_svg(plan, colors, lines, edge_labels, ink), body,
        f"<script>//<![CDATA[{_JS}//]]></script></body></html>\n",
    ])


def to_html(plan: Plan) -> str:
    """The whole page as a string (UTF-8, no external resources)."""
    colors = node_colors(plan)
    c = plan.cluster
    title = f"plan {plan.id}: {plan.graph} on {c['n_nodes']} x {c['n_gpus_per_node']} {c['gpu']}"
    summary = (
        f"allocation <code>{escape(plan.allocation)}</code>; mode {escape(plan.mode)} (max staleness "
        f"{plan.max_staleness}); predicted step {plan.step_time_s:.2f} s (generation {plan.generation_s:.2f} s, "
        f"training {plan.training_s:.2f} s, weight sync {plan.sync_s:.2f} s); idle {plan.idle_fraction:.1%}"
    )
    why = [f"bottleneck: {bottleneck(plan)}", runner_up(plan), memory_line(plan)]
    explained = "".join(f"<li>{escape(line)}</li>" for line in why if line)
    explained += "".join(f'<li class="warn">WARNING: {escape(w)}</li>' for w in plan.warnings)
    explained += "".join(f"<li>assumed: {escape(a)}</li>" for a in assumptions(plan))
    return "".join([
        '<!DOCTYPE html>\n<html xmlns="http://www.w3.org/1999/xhtml" lang="en"><head><meta charset="utf-8"/>',
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1><p>{summary}</p><ul>{explained}</ul>",
        "<h2>graph</h2>", _graph_svg(plan, colors),
        "<h2>devices by machine</h2>",
        "<p>solid outline: a tensor-parallel group (one DP rank of a stage); dashed: a pipeline stage</p>",
        _machines_svg(plan, colors),
        "<h2>nodes</h2>", _node_table(plan, colors),
        f"<h2>plan table</h2><pre>{escape(format_table(plan))}</pre>",
        f"<script>//<![CDATA[{_JS}//]]></script></body></html>\n",
    ])
