"""Compiler building blocks against hand-computed figures: model sizes, device presets,
memory per device, time formulas, mesh alignment and strategy validation."""

import json

import pytest

from areal_flow.config_compile import ClusterConfig, CompileConfig, CompileConfigError, check_config
from compiler.hardware import DEVICE_PRESETS, GIB, device_spec
from compiler.memory import generation_memory, kv_bytes_per_sequence, training_memory
from compiler.mesh import MeshError, MeshSpec, aligned_sizes, pack
from compiler.models import MODEL_PRESETS, ModelSpec, ModelSpecError, resolve_model
from compiler.strategy import ParallelStrategy, StrategyError
from compiler.timing import Links, ring_all_reduce_s, training_time, weight_sync_time

# Llama-2-7B shape (Touvron et al. 2023): published 6.74 B parameters.
# per layer: attention 4 * 4096^2 = 67,108,864 + 2 norms 8,192; MLP 3 * 4096 * 11008 = 135,266,304
# -> 202,383,360 x 32 layers = 6,476,267,520; embeddings 2 * 32000 * 4096 = 262,144,000; final norm 4,096
LLAMA2_7B = ModelSpec("llama2-7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=32, head_dim=128,
                      vocab=32000, intermediate=11008)
LLAMA2_7B_PARAMS = 6_476_267_520 + 262_144_000 + 4_096  # = 6,738,415,616


# -- models --------------------------------------------------------------------------
# Published totals (Hugging Face model cards / technical reports), billions.
PUBLISHED = {
    "Qwen2.5-0.5B": 0.49, "Qwen2.5-1.5B": 1.54, "Qwen2.5-7B": 7.61, "Qwen2.5-32B": 32.5,
    "Qwen2.5-72B": 72.7, "Llama-3-8B": 8.03, "Llama-3-70B": 70.6, "Qwen3-30B-A3B": 30.5,
    "SmolLM2-135M": 0.135, "tiny-arith": 0.00099,  # areal_flow.models.tiny: "~1.0 M parameters"
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published_sizes(name):
    spec = resolve_model(name)
    assert spec.n_params / 1e9 == pytest.approx(PUBLISHED[name], rel=0.03)


def test_moe_active_parameters_and_hand_count():
    spec = resolve_model("Qwen3-30B-A3B")
    assert spec.n_active_params / 1e9 == pytest.approx(3.3, rel=0.03)  # model card: 3.3 B activated
    assert LLAMA2_7B.n_params == LLAMA2_7B_PARAMS


def test_config_json_file_and_folder(tmp_path):
    config = dict(MODEL_PRESETS["Qwen2.5-7B"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    for spec in (str(tmp_path), str(tmp_path / "config.json")):
        assert resolve_model(spec).n_params == resolve_model("Qwen2.5-7B").n_params
    assert resolve_model("Qwen/qwen2.5-7b").hidden == 3584  # hub prefix and case ignored
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSpecError, match="hidden_size"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelSpecError, match="not a preset"):
        resolve_model("no-such-model")


def test_device_presets_and_config_checks():
    for name in ("H100", "H200", "A100-80G", "H800", "L40S", "cpu"):
        spec = DEVICE_PRESETS[name]
        assert spec.peak_flops > 0 and spec.memory_bytes > 0 and spec.inter_node_bandwidth > 0
    assert device_spec("h100").memory_gib == pytest.approx(79.65, abs=0.01)  # 81,559 MiB / 1024
    with pytest.raises(CompileConfigError, match="cluster.gpu"):
        device_spec("B300")
    with pytest.raises(CompileConfigError, match="compile.mode"):
        check_config(ClusterConfig(), CompileConfig(mode="both"))
    with pytest.raises(CompileConfigError, match="compile.mfu"):
        check_config(ClusterConfig(), CompileConfig(mfu=1.5))


# -- memory --------------------------------------------------------------------------
def _states(mem):
    return mem.weights + mem.gradients + mem.optimizer


def test_mixed_precision_adam_is_16_bytes_per_param_unsharded():
    # 7e9 params x 16 B = 1.12e11 B = 104.3 GiB (the figure); Llama-2-7B shape:
    # 6,738,415,616 x 16 = 107,814,649,856 B = 100.41 GiB.
    mem = training_memory(LLAMA2_7B, ParallelStrategy(), tokens_per_step=4096, micro_batches=1,
                          dtype="bf16", sharded=False, checkpointing=True)
    assert _states(mem) == 107_814_649_856
    assert _states(mem) / GIB == pytest.approx(100.41, abs=0.01)
    assert mem.weights == 2 * LLAMA2_7B_PARAMS and mem.optimizer == 12 * LLAMA2_7B_PARAMS


def test_zero3_shards_states_over_dp_plus_two_gathered_layers():
    # 107,814,649,856 / 8 = 13,476,831,232; two gathered bf16 layers: 2 x 2 x 202,383,360 = 809,533,440
    mem = training_memory(LLAMA2_7B, ParallelStrategy(dp=8), tokens_per_step=4096, micro_batches=1,
                          dtype="bf16", sharded=True, checkpointing=True)
    assert _states(mem) == 13_476_831_232 + 809_533_440


def test_activations_with_and_without_checkpointing():
    kw = dict(tokens_per_step=8 * 4096, micro_batches=1, dtype="bf16", sharded=False)
    # no recompute: 32 layers x 34 x 32768 x 4096 = 146,028,888,064; logits 8 x 32768 x 32000 = 8,388,608,000
    full = training_memory(LLAMA2_7B, ParallelStrategy(), checkpointing=False, **kw)
    assert full.activations == 146_028_888_064 + 8_388_608_000
    # recompute: 32 x 2 x 32768 x 4096 = 8,589,934,592 + one layer 34 x 32768 x 4096 = 4,563,402,752 + logits
    ckpt = training_memory(LLAMA2_7B, ParallelStrategy(), checkpointing=True, **kw)
    assert ckpt.activations == 8_589_934_592 + 4_563_402_752 + 8_388_608_000
    # tp2 pp2, m=4: 8192 tokens/micro-batch; 2 in flight x 16 layers x 2 x 8192 x 4096 / 2 = 1,073,741,824;
    # one layer 34 x 8192 x 4096 / 2 = 570,425,344; logits 8 x 8192 x 32000 / 2 = 1,048,576,000
    split = training_memory(LLAMA2_7B, ParallelStrategy(tp=2, pp=2), checkpointing=True,
                            **{**kw, "micro_batches": 4})
    assert split.activations == 1_073_741_824 + 570_425_344 + 1_048_576_000


def test_kv_cache_and_generation_weights():
    qwen7b = resolve_model("Qwen2.5-7B")
    # 2 (K, V) x 28 layers x 4 KV heads x 128 dims x 2 B = 57,344 B/token; x 2048 tokens = 117,440,512
    assert kv_bytes_per_sequence(qwen7b, ParallelStrategy(), 2048, "bf16") == 117_440_512
    assert kv_bytes_per_sequence(qwen7b, ParallelStrategy(tp=2), 2048, "bf16") == 117_440_512 / 2
    mem = generation_memory(qwen7b, ParallelStrategy(), concurrent=10, seq_len=2048, dtype="bf16")
    assert mem.weights == 2 * 7_615_616_512 and mem.kv_cache == 10 * 117_440_512


# -- time ----------------------------------------------------------------------------
def _links(**overrides):
    base = dict(name="unit", peak_flops=1e15, memory_bytes=80 * GIB, hbm_bandwidth=1e12,
                intra_node_bandwidth=100e9, inter_node_bandwidth=10e9, host_bandwidth=10e9,
                collective_latency_s=0.0)
    from compiler.hardware import DeviceSpec
    return Links(DeviceSpec(**{**base, **overrides}), devices_per_node=8, efficiency=1.0)


def test_ring_all_reduce():
    # 2 x (8-1)/8 x 1e9 B / 100e9 B/s = 0.0175 s
    assert ring_all_reduce_s(1e9, 8, 100e9, 0.0) == pytest.approx(0.0175)
    assert ring_all_reduce_s(1e9, 1, 100e9, 1.0) == 0.0


def test_training_compute_and_pipeline_bubble():
    kw = dict(n_sequences=8, seq_len=4096, dtype="bf16", sharded=True, checkpointing=False,
              forward_only=False, mfu=0.5, links=_links(), mesh_spans_nodes=False)
    t = training_time(LLAMA2_7B, ParallelStrategy(dp=8), micro_batches=1, **kw)
    # per token 3 x (2 x 6,738,415,616 + 2 x 32 x 4096 x 4096) = 43,651,719,168 FLOP; x 32768 tokens
    # = 1.43038e15 FLOP / (8 devices x 1e15 x 0.5) = 0.357596 s
    assert t["compute"] == pytest.approx(43_651_719_168 * 32768 / 4e15)
    assert t["bubble"] == 0.0
    piped = training_time(LLAMA2_7B, ParallelStrategy(dp=2, pp=4), micro_batches=4, **kw)
    busy = piped["compute"] + piped["tp_comm"]
    # bubble fraction (p-1)/(m+p-1) = 3/7 of the pipelined time
    assert piped["bubble"] / (busy + piped["bubble"]) == pytest.approx(3 / 7)


def test_weight_sync_bytes_over_slowest_link():
    qwen7b = resolve_model("Qwen2.5-7B")
    seconds, nbytes, link = weight_sync_time(qwen7b, ParallelStrategy(dp=2, tp=4), train_devices=24,
                                             dtype="bf16", same_machine=False, links=_links())
    # a bf16 channel keeps the LM head (152,064 x 3,584 = 544,997,376) and the vectors (28 layers x
    # (2 x 3,584 norms + 3,584 + 2 x 512 q/k/v biases) + 3,584 final norm = 333,312) in fp32:
    # one copy = 2 x (7,615,616,512 - 545,330,688) + 4 x 545,330,688 = 16,321,894,400 B;
    # each generation device receives a quarter (tp=4): 4,080,473,600 B over the 10 GB/s network;
    # the trainers send 2 copies / 24 devices = 1,360,157,867 B each (smaller)
    assert link == "inter-node" and nbytes == 2 * 16_321_894_400
    assert seconds == pytest.approx(4_080_473_600 / 10e9)
    fast, _, link = weight_sync_time(qwen7b, ParallelStrategy(dp=2, tp=4), train_devices=24,
                                     dtype="bf16", same_machine=True, links=_links())
    assert link == "intra-node" and fast == pytest.approx(4_080_473_600 / 100e9)
    full, _, _ = weight_sync_time(qwen7b, ParallelStrategy(dp=1), train_devices=1, dtype="fp32", same_machine=True,
                                  links=_links())
    assert full == pytest.approx(4 * 7_615_616_512 / 100e9)  # fp32: every tensor in 4 bytes


def test_a_bf16_channel_sends_smollm2_in_the_bytes_a_run_measures():
    # 2 x (134,515,008 - 49,152 x 576 - 35,136 vectors) + 4 x (28,311,552 + 35,136): the
    # weights/bytes a chat-job run logs with a bf16 engine (steps.jsonl, 325,723,392)
    from compiler.timing import wire_bytes

    assert wire_bytes(resolve_model("SmolLM2-135M"), "bf16") == 325_723_392


# -- meshes and strategies ----------------------------------------------------------
def test_mesh_alignment_rules():
    MeshSpec(0, 1, 4, 4).validate(2, 8)
    MeshSpec(1, 2, 0, 8).validate(3, 8)
    for bad in (MeshSpec(0, 1, 2, 4), MeshSpec(0, 1, 0, 3), MeshSpec(0, 2, 0, 4), MeshSpec(2, 2, 0, 8)):
        with pytest.raises(MeshError):
            bad.validate(3, 8)
    assert aligned_sizes(3, 8) == [1, 2, 4, 8, 16, 24]


def test_pack_is_first_fit_on_aligned_blocks():
    # 2 then 4 inside one machine: [0,2) and [4,8); then 8 takes the next whole machine
    assert pack([2, 4, 8], 2, 8) == [MeshSpec(0, 1, 0, 2), MeshSpec(0, 1, 4, 4), MeshSpec(1, 1, 0, 8)]
    assert pack([4, 16], 3, 8) == [MeshSpec(0, 1, 0, 4), MeshSpec(1, 2, 0, 8)]
    with pytest.raises(MeshError, match="do not fit"):
        pack([8, 16], 2, 8)


def test_pack_places_largest_first_when_the_given_order_does_not_fit():
    # 3 devices: 1 first takes device 0 and leaves no aligned pair ({0,1} or {2,3}); largest
    # first puts the pair on 0-1 and the 1 on device 2, returned in the order asked
    assert pack([1, 2], 1, 3) == [MeshSpec(0, 1, 2, 1), MeshSpec(0, 1, 0, 2)]
    # the given order is kept whenever it fits (4 devices: 1 at 0, the pair at 2-3)
    assert pack([1, 2], 1, 4) == [MeshSpec(0, 1, 0, 1), MeshSpec(0, 1, 2, 2)]
    # 1 + 2 + 4 on 7 devices: in order 1@0, 2@2, then no aligned 4 (4-7 is past 7); largest first 4@0, 2@4, 1@6
    assert pack([1, 2, 4], 1, 7) == [MeshSpec(0, 1, 6, 1), MeshSpec(0, 1, 4, 2), MeshSpec(0, 1, 0, 4)]
    with pytest.raises(MeshError, match="do not fit"):
        pack([2, 2], 1, 3)


def test_strategy_rules_per_model():
    qwen7b = resolve_model("Qwen2.5-7B")  # 28 heads, 4 KV heads, 28 layers, dense
    shape = dict(n_layers=qwen7b.n_layers, n_heads=qwen7b.n_heads, n_kv_heads=qwen7b.n_kv_heads,
                 n_experts=qwen7b.n_experts, gpus_per_node=8)
    ParallelStrategy(dp=2, tp=4).validate_for(**shape)
    with pytest.raises(StrategyError, match="KV heads"):
        ParallelStrategy(tp=8).validate_for(**shape)  # 8 does not divide 4 KV heads
    with pytest.raises(StrategyError, match="layers"):
        ParallelStrategy(pp=3).validate_for(**shape)
    with pytest.raises(StrategyError, match="Mixture-of-Experts"):
        ParallelStrategy(dp=2, ep=2).validate_for(**shape)
    moe = resolve_model("Qwen3-30B-A3B")
    ParallelStrategy(dp=8, ep=8).validate_for(n_layers=48, n_heads=32, n_kv_heads=4,
                                              n_experts=moe.n_experts, gpus_per_node=8)


def test_names_the_runtime_loads_resolve_alike(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    # the runtime's GGUF preset name, and hub ids of instruct variants (their config.json is the base's)
    assert resolve_model("smollm2-135m").name == "SmolLM2-135M"
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").name == "SmolLM2-135M"
    assert resolve_model("Qwen/Qwen2.5-7B-Instruct").name == "Qwen2.5-7B"
    smol = resolve_model("smollm2-135m")  # SmolLM2-135M's config.json: 30 layers, hidden 576, 9 heads, 3 KV heads
    assert (smol.n_layers, smol.hidden, smol.n_heads, smol.n_kv_heads) == (30, 576, 9, 3)
    # a folder under the home directory, written with "~" as the runtime accepts it
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 100}))
    assert resolve_model("~/m").hidden == 64
    with pytest.raises(ModelSpecError, match="not in the local Hugging Face cache"):
        resolve_model("acme/not-cached")
