"""Compiler outputs: plan.json round trip and schema, the terminal table (numbers derived
by hand), and the placement drawings (HTML well-formed with every node and GPU; DOT;
SVG/PNG via Graphviz)."""

import json
import shutil
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from areal_flow.graph import Edge, Graph, ModelRef, Node
from compiler import ClusterConfig, CompileConfig, Plan, compile_plan, format_table
from areal_flow.config_compile import LengthDistConfig
from compiler.plan import PlanSchemaError
from compiler.render import render
from compiler.viz import to_dot


def grpo_7b() -> Graph:
    """GRPO on Qwen2.5-7B: 8 samples per prompt, 1024 new tokens, staleness 1."""
    g = Graph("grpo", {})
    g.add_model(ModelRef("policy", "Qwen2.5-7B"))
    for node in [Node("dataset", "dataset"),
                 Node("generate", "generate", "policy", {"n_samples": 8, "max_new_tokens": 1024, "engine": "vllm"}),
                 Node("reward", "reward"), Node("advantage", "advantage"),
                 Node("train_step", "train_step", "policy", {"algorithm": "grpo", "max_staleness": 1}),
                 Node("sync_weights", "sync_weights", "policy")]:
        g.add_node(node)
    g.add_edge(Edge("dataset", "prompts", "generate", "prompts"))
    g.add_edge(Edge("generate", "rollouts", "reward", "rollouts"))
    g.add_edge(Edge("generate", "rollouts", "advantage", "rollouts"))
    g.add_edge(Edge("reward", "rewards", "advantage", "rewards"))
    g.add_edge(Edge("advantage", "advantages", "train_step", "advantages", max_staleness=1))
    g.add_edge(Edge("train_step", "weights", "sync_weights", "weights", "weights"))
    g.add_edge(Edge("sync_weights", "weights", "generate", "weights", "weights"))
    return g


@pytest.fixture(scope="module")
def plan() -> Plan:
    # every response at its budget (fixed, mean 1), no per-step overhead and no DP traffic
    # hidden behind compute, so the numbers below can be derived by hand
    cfg = CompileConfig(length_dist=LengthDistConfig(kind="fixed", mean=1.0), decode_step_overhead_s=0.0,
                        fsdp_overlap=0.0)
    return compile_plan(grpo_7b(), ClusterConfig(n_nodes=4, n_gpus_per_node=8, gpu="H100"), cfg, batch_groups=48)


def test_json_round_trip(plan):
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan and again.to_json() == text
    assert json.loads(text)["schema_version"] == 3
    assert again.node("train_step").parallel.tp == plan.node("train_step").parallel.tp


def test_json_schema_errors(plan):
    data = plan.to_dict()
    with pytest.raises(PlanSchemaError, match="schema_version"):
        Plan.from_dict({**data, "schema_version": 99})
    del data["allocation"]
    with pytest.raises(PlanSchemaError, match="allocation"):
        Plan.from_dict(data)
    with pytest.raises(PlanSchemaError, match="line 1"):
        Plan.from_json("{not json")
    moved = plan.to_dict()
    moved["nodes"][1]["mesh"]["first_device"] = 2  # 8 devices starting at device 2: not aligned
    with pytest.raises(PlanSchemaError, match="generate"):
        Plan.from_dict(moved)


def test_table_numbers_match_the_hand_derivation(plan):
    # Qwen2.5-7B: 7,615,616,512 params; 48 prompts x 8 = 384 responses of 512 + 1024 tokens (384 divides
    # by the trainer's 12 DP ranks: compiler.executable); H100 989.5 TFLOP/s, 3.35 TB/s, MFU 0.4, bandwidth
    # efficiency 0.8 (HBM 2.68e12 B/s, NVLink 360e9 B/s, network 40e9 B/s), 10 us per collective.
    # generate d2t4 on n0: 192 responses per replica, all in its KV cache (c192);
    #   weights 2 x 7.6156e9 / 4 = 3.81e9 B = 3.5 GiB; KV 57,344 B/token x 1536 / 4 x 192 = 4.23e9 B = 3.9 GiB;
    #   prefill of its 24 prompts (each group's 8 responses share one) 12,288 tokens x (2 x 7.6156e9
    #   + 2 x 28 x 512 x 3584 = 1.5334e10) FLOP = 1.8842e14 / (4 x 989.5e12 x 0.4) = 0.119 s;
    #   k = 1 refills slots: 192 x 1024 / 192 = 1024 steps at 192 live responses of mean context
    #   512 + 1023/2 = 1023.5: (1.523e10 weights + 192 x 1023.5 x 57,344 = 1.1269e10 KV) / (4 x 2.68e12)
    #   = 2.47 ms (> 1.9 ms compute) + 56 TP all-reduces x (2 x 3/4 x 192 x 7168 B / 360e9 + 10 us) = 0.88 ms
    #   -> 3.35 ms x 1024 = 3.43 s.
    # train_step d12t2 on n1-3: 589,824 tokens x 4 x (2 x 7.6156e9 + 2 x 28 x 1536 x 3584) FLOP
    #   = 3.666e16 / (24 x 989.5e12 x 0.4) = 3.86 s; TP 168 all-reduces x 0.99 ms = 0.17 s;
    #   ZeRO-3 3 x 11/12 x 7.6156e9 B / 40e9 B/s = 0.52 s -> 4.55 s (activations do not fit without
    #   recomputation, so auto activation checkpointing turns it on: 'ac').
    # sync: bf16 matrices, the LM head (152,064 x 3,584) and 333,312 vector elements in fp32: one copy
    #   2 x (7.6156e9 - 5.4533e8) + 4 x 5.4533e8 = 1.6322e10 B, a quarter (t4) per generation device
    #   4.0805e9 B / 40e9 B/s = 0.102 s; step max(0.119 + 3.43, 4.545) + 0.102 = 4.647 s.
    assert plan.allocation == "gen:d2t4 + train:d12t2"
    gen, train = plan.node("generate"), plan.node("train_step")
    assert gen.concurrent == 192 and train.micro_batches == 1 and train.activation_checkpointing
    assert gen.memory["weights"] == pytest.approx(2 * 7_615_616_512 / 4)
    assert gen.memory["kv_cache"] == pytest.approx(57_344 * 1536 / 4 * 192)
    assert gen.times["prefill"] == pytest.approx(1.8842e14 / (4 * 989.5e12 * 0.4), rel=1e-3)
    assert gen.times["decode"] == pytest.approx(3.43, abs=0.005)
    assert train.times["compute"] == pytest.approx(3.666e16 / (24 * 989.5e12 * 0.4), rel=1e-3)
    assert train.times["tp_comm"] == pytest.approx(0.17, abs=0.005)
    assert train.times["dp_comm"] == pytest.approx(3 * (11 / 12 * 2 * 7_615_616_512 / 2 / 40e9 + 10e-6), rel=1e-6)
    kept = 152_064 * 3_584 + 333_312
    assert plan.sync_s == pytest.approx((2 * (7_615_616_512 - kept) + 4 * kept) / 4 / 40e9 + 10e-6, rel=1e-6)
    assert plan.step_time_s == pytest.approx(4.647, abs=0.005)
    table = format_table(plan)
    for text in ("gen:d2t4 + train:d12t2", "d2t4 c192", "7.5 GiB (w 3.5 kv 3.9)", "prefill 0.12 decode 3.43",
                 "d12t2 m1 ac", "compute 3.86 tp_comm 0.17 dp_comm 0.52", "step time 4.65 s = max(gen, train) + sync"):
        assert text in table, text
    # headroom: usable 0.9 x 81,559 MiB = 71.7 GiB; generate uses 3,807,808,256 + 4,227,858,432 B = 7.48 GiB
    # -> 64.2 GiB free. Training (4.55 s) bounds max(3.55, 4.55), and compute is its largest part.
    # The next allocation gives generation one replica (gen:d1t4): 384 live responses a decode step,
    # compute-bound: (2 x 7.6156e9 x 384 + 2 x 28 x 3584 x 384 x 1023.5) FLOP / (4 x 989.5e12 x 0.4) = 3.74 ms
    # (> memory 3.52 ms) + 56 TP all-reduces x (2 x 3/4 x 384 x 7168 B / 360e9 + 10 us) = 1.20 ms -> 4.94 ms
    # x 1024 = 5.06 s of decode, 1.63 s more. Bandwidths x 0.8: NVLink 450 -> 360 GB/s, network 50 -> 40 GB/s.
    for text in ("64.2 of 71.7 GiB free", "bottleneck: train_step (4.55 s, most in compute 3.86 s; training bounds",
                 "usable 71.7 of 79.6 GiB (compile.memory_fraction=0.9", "beats the next allocation 'gen:d1t4 + train:d12t2'", "generate.decode +1.63 s",
                 "NVLink 360 GB/s, network 40 GB/s", "MFU 0.4"):
        assert text in table, text
    assert not plan.warnings


def test_warnings_for_a_slow_colocated_manual_allocation():
    # 4 devices of 32 time-share generation and training: 28 idle; the graph's k = 1 asks for
    # asynchrony, which a shared mesh cannot give; the search's best is far faster.
    plan = compile_plan(grpo_7b(), ClusterConfig(n_nodes=4, n_gpus_per_node=8, gpu="H100"),
                        CompileConfig(allocation="gen:d4 | train:d4"), batch_groups=64)
    best = plan.alternatives[1]
    assert plan.alternatives[0].allocation == "gen:d4 | train:d4" and best.step_time_s * 1.2 < plan.step_time_s
    slower, idle, colocated = plan.warnings
    assert slower.startswith("the allocation given ('gen:d4 | train:d4'") and f"'{best.allocation}'" in slower
    assert f"{plan.step_time_s / best.step_time_s:.1f}x slower" in slower
    assert idle == "28 of 32 devices hold no node and stay idle"
    assert "asynchronous training was asked" in colocated and "do not overlap" in colocated
    table = format_table(plan)
    assert table.count("WARNING: ") == 3 and "is slower than the next allocation" in table


class _Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.gpus, self.nodes, self.tags = set(), set(), []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if "data-gpu" in attrs:
            self.gpus.add(attrs["data-gpu"])
        if "data-node" in attrs:
            self.nodes.update(attrs["data-node"].split())


def test_html_is_well_formed_and_complete(plan, tmp_path):
    path = render(plan, tmp_path / "plan.html")
    text = path.read_text()
    ET.fromstring(text.split("\n", 1)[1])  # XHTML: parses as XML (raises if not well-formed)
    parser = _Collector()
    parser.feed(text)
    assert parser.gpus == {f"n{m}:g{d}" for m in range(4) for d in range(8)}
    assert {n.name for n in plan.nodes} <= parser.nodes
    assert "http" not in text.replace("http://www.w3.org", "")  # no network resources
    assert "weight sync train_step -&gt; generate" in text and "staleness &lt;= 1" in text
    assert "bottleneck: train_step" in text and "<th>m (micro-batches)</th>" in text


def test_html_outlines_tp_groups_and_pipeline_stages(tmp_path):
    # gen d2t4 on n0: 2 TP groups of 4; train d4t2p2 on n1-2: 8 TP groups of 2 and 2 stages of 8
    # devices, each stage one whole machine -> 10 solid outlines and 2 dashed ones.
    plan = compile_plan(grpo_7b(), ClusterConfig(n_nodes=4, n_gpus_per_node=8, gpu="H100"),
                        CompileConfig(allocation="gen:d2t4 + train:d4t2p2"), batch_groups=64)
    text = render(plan, tmp_path / "plan.html").read_text()
    outlines = [line for line in text.split("<rect") if 'fill="none"' in line and 'stroke="#111"' in line]
    dashed = [line for line in outlines if "stroke-dasharray" in line]
    assert (len(outlines) - len(dashed), len(dashed)) == (10, 2)


def test_dot_and_graphviz_formats(plan, tmp_path):
    dot = to_dot(plan)
    for n in plan.nodes:
        assert f'"{n.name}"' in dot
    assert "weight sync" in dot and "machine n1-3" in dot
    assert render(plan, tmp_path / "plan.dot").read_text() == dot
    if shutil.which("dot") is None:
        pytest.skip("Graphviz 'dot' program not installed")
    svg = render(plan, tmp_path / "plan.svg").read_text()
    ET.fromstring(svg[svg.index("<svg"):])
    assert render(plan, tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="suffix"):
        render(plan, tmp_path / "plan.pdf")


def test_html_labels_fit_their_gaps_and_stay_off_the_machines(tmp_path):
    # 16 x 8: four rows of machines; a long edge label (the timeline's mean waits) on every
    # data edge. Checked on the SVG: each data-edge label's width (11 px text at <= 6.5 px a
    # character, Helvetica/Arial's widest average) lies between the two boxes it joins, and
    # each weight-sync label lies below every machine box.
    from compiler.viz_html import BOX_W, graph_page

    plan = compile_plan(grpo_7b(), ClusterConfig(n_nodes=16, n_gpus_per_node=8, gpu="H100"), CompileConfig(),
                        batch_groups=64)
    labels = {f"{e.src}->{e.dst}": "mean wait 1234.5 ms, 17 items" for e in plan.edges if e.kind != "weights"}
    page = graph_page("t", plan, {n.name: "#ccc" for n in plan.nodes}, {n.name: [n.name] for n in plan.nodes},
                      labels, {}, render(plan, tmp_path / "p.html").read_text().split("<body>", 1)[1])
    svgs = [ET.fromstring(s[:s.index("</svg>") + 6]) for s in ("<svg" + p for p in page.split("<svg")[1:])]
    ns = "{http://www.w3.org/2000/svg}"
    graph, machines = svgs[0], svgs[2]
    boxes = [(float(r.get("x")), float(r.get("y"))) for r in graph.iter(ns + "rect")]
    edge_texts = [t for t in graph.iter(ns + "text") if t.text and t.text.startswith("staleness")
                  or t.text and t.text.startswith("mean wait")]
    assert edge_texts
    for t in edge_texts:
        x, y, half = float(t.get("x")), float(t.get("y")), 6.5 * len(t.text) / 2
        row = [bx for bx, by in boxes if by <= y <= by + 58]
        left = max(bx + BOX_W for bx in row if bx + BOX_W <= x)
        right = min(bx for bx in row if bx >= x)
        assert left <= x - half and x + half <= right, (t.text, left, x - half, x + half, right)
    machine_bottom = max(float(r.get("y")) + float(r.get("height")) for r in machines.iter(ns + "rect"))
    sync = [t for t in machines.iter(ns + "text") if t.text and t.text.startswith("weight sync")]
    assert sync and all(float(t.get("y")) - 11 > machine_bottom for t in sync)
