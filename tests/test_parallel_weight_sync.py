"""Weight sync from sharded training layouts delivers exactly the single-process weights.

Two trainings on 2 processes (gloo): TP=2 synced to a TP=1 generation engine,
and DP=2 (FSDP) resharded for a TP=2 generation engine. Weights are the
initial ones (loaded from one state dict), so equality is exact, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from compiler.strategy import ParallelStrategy
from runtime.parallel.apply import parallelize
from runtime.parallel.launch import spawn_workers
from runtime.parallel.mesh import build_device_mesh
from runtime.parallel.weight_sync import bucket_checksum, iter_weight_buckets, reshard_for_tp
from test_parallel_helpers import build_model

BUCKET_BYTES = 16 * 1024  # the tiny model is ~150 KB of fp32 weights: about ten buckets


def sync_worker(rank: int, world_size: int, state: dict) -> dict:
    out = {}
    mesh = build_device_mesh(ParallelStrategy(tp=2), "cpu")
    module = parallelize(build_model("dense", state), ParallelStrategy(tp=2), mesh).module
    out["tp2_buckets"] = [(bucket.tensors, bucket.checksum) for bucket in iter_weight_buckets(module, BUCKET_BYTES)]
    out["tp2_local"] = {name: p.to_local().clone() for name, p in module.named_parameters() if isinstance(p, DTensor)}
    mesh = build_device_mesh(ParallelStrategy(dp=2), "cpu")
    module = parallelize(build_model("dense", state), ParallelStrategy(dp=2), mesh).module
    out["dp2_to_tp2"] = []
    for bucket in iter_weight_buckets(module, BUCKET_BYTES):
        shards = [reshard_for_tp(bucket.tensors, tp_rank, 2) for tp_rank in range(2)]
        out["dp2_to_tp2"].append([(shard, bucket_checksum(shard)) for shard in shards])
    return out


@pytest.fixture(scope="module")
def synced():
    torch.set_num_threads(1)
    state = build_model("dense").state_dict()
    return spawn_workers(sync_worker, 2, (state,)), state


@pytest.mark.slow
def test_tp2_to_tp1_delivers_the_single_process_weights(synced):
    per_rank, state = synced
    buckets = per_rank[0]["tp2_buckets"]
    assert len(buckets) > 1  # gathered bucket by bucket, never the whole model at once
    delivered = {}
    for tensors, checksum in buckets:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= BUCKET_BYTES or len(tensors) == 1
        assert checksum == bucket_checksum({name: state[name] for name in tensors})
        delivered |= tensors
    assert sorted(delivered) == sorted(state)
    for name, expected in state.items():
        assert torch.equal(delivered[name], expected), name
    assert [c for _, c in per_rank[1]["tp2_buckets"]] == [c for _, c in buckets]  # every rank got the same buckets


@pytest.mark.slow
def test_dp2_to_tp2_reshard_delivers_the_single_process_shards(synced):
    per_rank, state = synced
    tp2_local = [per_rank[rank]["tp2_local"] for rank in range(2)]
    seen = set()
    for bucket in per_rank[0]["dp2_to_tp2"]:
        for tp_rank, (shard, checksum) in enumerate(bucket):
            expected = reshard_for_tp({name: state[name] for name in shard}, tp_rank, 2)
            assert checksum == bucket_checksum(expected)
            for name, tensor in shard.items():
                assert torch.equal(tensor, expected[name]), name
                if name in tp2_local[tp_rank]:  # the cut equals what a real TP=2 model holds
                    assert torch.equal(tensor, tp2_local[tp_rank][name]), name
            seen |= set(shard)
    assert seen == set(state)
    # per layer 7 linear weights + 3 q/k/v biases, times 4 layers, + embedding + LM head = 42 sharded
    assert set(tp2_local[0]) <= seen and len(tp2_local[0]) == 42


def test_checksum_changes_with_any_byte_or_name():
    tensors = {"a": torch.zeros(3), "b": torch.ones(2, dtype=torch.bfloat16)}
    base = bucket_checksum(tensors)
    assert base == bucket_checksum({"b": tensors["b"].clone(), "a": tensors["a"].clone()})  # order-free
    assert base != bucket_checksum({"a": torch.tensor([0.0, 0.0, 1e-30]), "b": tensors["b"]})
    assert base != bucket_checksum({"c": tensors["a"], "b": tensors["b"]})
    assert base != bucket_checksum({"a": tensors["a"].reshape(3, 1), "b": tensors["b"]})


def test_bucket_bytes_must_be_positive():
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        next(iter_weight_buckets(torch.nn.Linear(2, 2), 0))
