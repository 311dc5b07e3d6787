"""Training-time terms the search trades off, against hand arithmetic: FSDP traffic per
micro-batch, the share hidden behind compute (compile.fsdp_overlap), and the all-to-alls
of expert parallelism."""

import pytest

from compiler.hardware import GIB, DeviceSpec
from compiler.strategy import ParallelStrategy
from compiler.timing import Links, training_time
from test_compiler_fixes import MOE

# 100 GB/s inside a machine, no latency, bandwidth taken as is
LINKS = Links(DeviceSpec("unit", peak_flops=1e15, memory_bytes=80 * GIB, hbm_bandwidth=1e12,
                         intra_node_bandwidth=100e9, inter_node_bandwidth=10e9, host_bandwidth=10e9,
                         collective_latency_s=0.0), devices_per_node=8, efficiency=1.0)


def _time(s, m, **kw):
    args = dict(n_sequences=4, seq_len=8, micro_batches=m, dtype="bf16", sharded=True, checkpointing=False,
                forward_only=False, mfu=0.5, links=LINKS, mesh_spans_nodes=False)
    return training_time(MOE, s, **{**args, **kw})


def test_fsdp_traffic_is_paid_per_micro_batch():
    # dp 4, ep 2: dense 776 params x 2 B = 1552 B gathered over 4 ranks, experts 3072 x 2 / 2 = 3072 B over 2;
    # per micro-batch two all-gathers and one reduce-scatter: 3 x (3/4 x 1552 + 1/2 x 3072) = 8100 B / 100e9
    s = ParallelStrategy(dp=4, ep=2)
    assert _time(s, 1, overlap=0.0)["dp_comm"] == pytest.approx(8100 / 100e9)
    assert _time(s, 4, overlap=0.0)["dp_comm"] == pytest.approx(4 * 8100 / 100e9)


def test_overlap_hides_traffic_up_to_the_compute():
    # compute: active params 776 + 2 layers x 1 expert x 3 x 8 x 16 = 1544; per token 3 x (2 x 1544
    # + 2 x 2 layers x 8 tokens x 2 heads x 4 dims = 256) = 10,032 FLOP; x 32 tokens / (4 x 1e15 x 0.5)
    compute = 32 * 10_032 / 2e15
    s = ParallelStrategy(dp=4, ep=2)
    t = _time(s, 1, overlap=1.0)
    assert t["compute"] == pytest.approx(compute)
    assert t["dp_comm"] == pytest.approx(8100 / 100e9 - compute)  # traffic (81 ns) > compute (0.16 ns)
    assert _time(s, 1, overlap=0.5)["dp_comm"] == pytest.approx(8100 / 100e9 - 0.5 * compute)


def test_expert_all_to_alls_per_layer():
    # one micro-batch of 32 / 4 ranks = 8 tokens per device, top-1: 8 x 8 hidden x 2 B = 128 B routed,
    # half of it leaves the device (ep 2); dispatch + combine forward and their gradients backward
    # = 4 all-to-alls per layer, 2 layers: 8 x 64 B / 100e9; recomputation adds 2 per layer: 12 x 64 B
    s = ParallelStrategy(dp=4, ep=2)
    assert _time(s, 1)["ep_comm"] == pytest.approx(8 * 64 / 100e9)
    assert _time(s, 1, checkpointing=True)["ep_comm"] == pytest.approx(12 * 64 / 100e9)


def test_micro_batches_are_chosen_for_time():
    # pp 2, cp 2, no sharding: with a 1 s latency per ring-attention pass and nearly free
    # bandwidth, a step costs busy x (m + 1) / m (bubble (p-1)/m) with busy = C + m x A, where
    # A = 1 layer per stage x 3 passes (forward, backward x2) x (cp - 1) x 1 s = 3 s per micro-batch.
    # Choosing peak FLOP/s so that C = 16 A = 48 s: f(1) = 51 x 2 = 102, f(2) = 54 x 3/2 = 81,
    # f(4) = 60 x 5/4 = 75, f(8) = 72 x 9/8 = 81, f(16) = 96 x 17/16 = 102 -> m = 4.
    from areal_flow.config_compile import ClusterConfig, CompileConfig, LengthDistConfig
    from compiler.cost import CostModel
    from compiler.models import ModelSpec
    from compiler.workload import TRAINING, DeviceTask, Workload

    dense = ModelSpec("dense", n_layers=2, hidden=8, n_heads=2, n_kv_heads=2, head_dim=4, vocab=10, intermediate=16)
    # 32 sequences of 8 prompt + 8 response tokens; per token 3 x (2 N + 2 x 2 x 16 x 8) FLOP
    flops = 32 * 16 * 3 * (2 * dense.n_params + 2 * 2 * 16 * 8)
    peak = flops / (4 * 1.0 * 48)  # 4 devices (pp 2 x cp 2), MFU 1
    device = DeviceSpec("slow", peak_flops=peak, memory_bytes=1e12, hbm_bandwidth=1e30, intra_node_bandwidth=1e30,
                        inter_node_bandwidth=1e30, host_bandwidth=1e30, collective_latency_s=1.0)
    task = DeviceTask("train_step", "train_step", TRAINING, "policy", dense)
    workload = Workload("g", (task,), {}, n_sequences=32, prompt_len=8, new_tokens=8, staleness=1, aliases={},
                        data_edges=(), ops={"train_step": "train_step"})
    cfg = CompileConfig(optimizer_sharding=False, activation_checkpointing=False, mfu=1.0, bandwidth_efficiency=1.0,
                        length_dist=LengthDistConfig(kind="fixed", mean=1.0))
    model = CostModel(workload, device, ClusterConfig(1, 4, "H100"), cfg)
    cost = model.cost(task, ParallelStrategy(pp=2, cp=2), False)
    assert cost.micro_batches == 4
    assert cost.times["compute"] == pytest.approx(48.0)
    assert cost.times["cp_comm"] == pytest.approx(4 * 3.0, rel=1e-9)
    # + one DDP all-reduce over dp x cp = 2 ranks: its 1 s latency, hidden behind 2/3 of one
    # micro-batch's compute (fsdp_overlap 1): exposed 0
    assert cost.times["dp_comm"] == pytest.approx(0.0, abs=1e-9)
    assert cost.time_s == pytest.approx(75.0, rel=1e-9)
