"""Search fixes against hand arithmetic: expert parameters divided by EP once, dp at most
the step's sequences, a critic's scalar head, generation TP replicating KV heads, and
DeepSeek configs refused."""

import pytest

from compiler import ClusterConfig, CompileConfig, compile_plan
from compiler.hardware import GIB, DeviceSpec
from compiler.memory import kv_bytes_per_sequence, training_memory
from compiler.models import MODEL_PRESETS, ModelSpec, ModelSpecError, spec_from_config
from compiler.strategy import ParallelStrategy, StrategyError
from compiler.timing import Links, training_time
from compiler.workload import build_workload
from test_compiler_search import grpo_graph

# A small MoE: h 8, 2 layers, 2 heads x 4 dims (2 KV heads), vocab 10 untied, 4 experts of width 16, top-1.
# per layer: attention 8x8 + 2x8x8 + 8x8 + 2 norms x 8 = 272; router 8 x 4 = 32; experts 4 x 3 x 8 x 16 = 1536
# -> dense 2 x (272 + 32) + embeddings 2 x 10 x 8 + final norm 8 = 608 + 168 = 776; experts 2 x 1536 = 3072
MOE = ModelSpec("moe", n_layers=2, hidden=8, n_heads=2, n_kv_heads=2, head_dim=4, vocab=10, intermediate=0,
                n_experts=4, experts_per_token=1, expert_intermediate=16)


def test_moe_states_with_ep_count_expert_sharding_once():
    assert (MOE.n_params, MOE.n_expert_params) == (776 + 3072, 3072)
    # dp 4, ep 4, ZeRO-3: dense 776 / 4 = 194 per device; each EP rank holds 1 expert of each layer,
    # 3072 / 4 = 768, and no other rank shares it (dp / ep = 1) -> 962 parameters' states per device.
    mem = training_memory(MOE, ParallelStrategy(dp=4, ep=4), tokens_per_step=64, micro_batches=1, dtype="bf16",
                          sharded=True, checkpointing=True)
    assert mem.gradients == 2 * 962 and mem.optimizer == 12 * 962
    # dp 4, ep 2: experts 3072 / 2 = 1536 per EP rank, sharded over the dp / ep = 2 ranks holding them: 768
    mem2 = training_memory(MOE, ParallelStrategy(dp=4, ep=2), tokens_per_step=64, micro_batches=1, dtype="bf16",
                           sharded=True, checkpointing=True)
    assert mem2.gradients == 2 * (194 + 768)


def test_moe_gradient_traffic_over_expert_data_parallel_ranks():
    links = Links(DeviceSpec("unit", peak_flops=1e15, memory_bytes=80 * GIB, hbm_bandwidth=1e12,
                             intra_node_bandwidth=100e9, inter_node_bandwidth=10e9, host_bandwidth=10e9,
                             collective_latency_s=0.0), devices_per_node=8, efficiency=1.0)
    t = training_time(MOE, ParallelStrategy(dp=4, ep=2), n_sequences=4, seq_len=8, micro_batches=1, dtype="bf16",
                      sharded=False, checkpointing=False, forward_only=False, mfu=0.5, links=links,
                      mesh_spans_nodes=False)
    # all-reduce of dense grads 2 x 776 B over 4 ranks: 2 x 3/4 x 1552 / 100e9;
    # expert grads 2 x 3072 / 2 = 3072 B over dp / ep = 2 ranks: 2 x 1/2 x 3072 / 100e9
    assert t["dp_comm"] == pytest.approx((2 * 3 / 4 * 1552 + 2 * 1 / 2 * 3072) / 100e9)


def test_moe_under_tp_keeps_experts_whole_on_each_tp_rank():
    """The RL trainer has no expert TP (``runtime.parallel.tensor_parallel``): the cost model agrees."""
    # tp 2, ep 2 over dp 2, no ZeRO: dense 776 / 2 = 388; experts 3072 / ep 2 = 1536 (not / tp) -> 1924
    mem = training_memory(MOE, ParallelStrategy(dp=2, tp=2, ep=2), tokens_per_step=64, micro_batches=1,
                          dtype="bf16", sharded=False, checkpointing=False)
    assert mem.gradients == 2 * 1924
    links = Links(DeviceSpec("unit", peak_flops=1e15, memory_bytes=80 * GIB, hbm_bandwidth=1e12,
                             intra_node_bandwidth=100e9, inter_node_bandwidth=10e9, host_bandwidth=10e9,
                             collective_latency_s=0.0), devices_per_node=8, efficiency=1.0)
    kw = dict(n_sequences=4, seq_len=8, micro_batches=1, dtype="bf16", sharded=False, checkpointing=False,
              forward_only=False, mfu=0.5, links=links, mesh_spans_nodes=False)
    dense, tp2 = training_time(MOE, ParallelStrategy(dp=2), **kw), training_time(MOE, ParallelStrategy(dp=2, tp=2), **kw)
    # the routed expert (top-1: 2 layers x 3 x 8 x 16 = 768 weights) runs whole on both TP ranks: of the
    # 32 tokens x 2 x 768 x 3 passes FLOPs, tp - 1 = 1 more copy, over 4 devices at 0.5 x 1e15
    extra = 32 * 2 * 768 * 3 / (4 * 1e15 * 0.5)
    assert tp2["compute"] == pytest.approx(dense["compute"] / 2 + extra)


def test_dp_never_exceeds_the_sequences_of_a_step():
    # 2 prompts x 4 samples = 8 sequences on 16 GPUs: no node may run more than 8 data-parallel ranks
    plan = compile_plan(grpo_graph("Qwen2.5-1.5B"), ClusterConfig(2, 8, "H100"),
                        CompileConfig(samples_per_prompt=4), batch_groups=2)
    for node in plan.nodes:
        if node.parallel is not None:
            assert node.parallel.dp <= 8, (node.name, node.strategy)


def test_critic_is_costed_with_a_scalar_head():
    graph = grpo_graph("Qwen2.5-7B", critic=True)
    graph.nodes["advantage"].attrs["model_role"] = "critic"
    w = build_workload(graph, CompileConfig(), 64)
    critic, policy = w.task("critic_step").model, w.task("train_step").model
    # Qwen2.5-7B: 7,615,616,512 with a 152,064 x 3,584 = 544,997,376 LM head; the value head is 3,584 x 1
    assert policy.n_params == 7_615_616_512
    assert critic.n_params == 7_615_616_512 - 544_997_376 + 3_584
    # logits memory: 8 bytes x tokens x 1 instead of x 152,064 (one micro-batch of 4096 tokens, no TP)
    lm = training_memory(policy, ParallelStrategy(), tokens_per_step=4096, micro_batches=1, dtype="bf16",
                         sharded=False, checkpointing=False)
    value = training_memory(critic, ParallelStrategy(), tokens_per_step=4096, micro_batches=1, dtype="bf16",
                            sharded=False, checkpointing=False)
    assert lm.activations - value.activations == 8 * 4096 * (152_064 - 1)


def test_generation_tp_may_replicate_kv_heads():
    # 32 query heads, 4 KV heads (a Llama-style GQA shape)
    wide = ModelSpec("wide", n_layers=28, hidden=4096, n_heads=32, n_kv_heads=4, head_dim=128, vocab=1000,
                     intermediate=1000)
    shape = dict(n_layers=28, n_heads=32, n_kv_heads=4, gpus_per_node=8)
    with pytest.raises(StrategyError, match="KV heads"):
        ParallelStrategy(tp=8).validate_for(**shape)  # a trainer splits KV heads: 8 does not divide 4
    ParallelStrategy(tp=8).validate_for(**shape, replicate_kv=True)  # an engine replicates them
    with pytest.raises(StrategyError, match="multiple of the KV heads"):
        ParallelStrategy(tp=2).validate_for(n_layers=28, n_heads=6, n_kv_heads=3, replicate_kv=True)
    # KV bytes per device and token at tp 8: 4 KV heads, one per rank (replicated twice):
    # 2 x 28 layers x 1 head x 128 dims x 2 B = 14,336 (not 2 x 28 x 4 x 128 x 2 / 8 = 7,168)
    assert kv_bytes_per_sequence(wide, ParallelStrategy(tp=8), 1, "bf16") == 14_336
    assert kv_bytes_per_sequence(wide, ParallelStrategy(tp=4), 1, "bf16") == 14_336


def test_deepseek_configs_are_refused_not_read_as_dense():
    config = dict(MODEL_PRESETS["Qwen2.5-7B"], model_type="deepseek_v3", kv_lora_rank=512, n_routed_experts=256)
    with pytest.raises(ModelSpecError, match="kv_lora_rank, n_routed_experts"):
        spec_from_config(config, "DeepSeek-V3")
