"""Shared pieces of the multi-process parallelism tests, plus tests of the pure helpers.

The workers below run in processes started by ``runtime.parallel.launch`` and
compare against :func:`reference_step`, a single-process run of the same model
(same state dict) and batch.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from compiler.strategy import ParallelStrategy
from runtime.parallel.apply import ParallelConfig, parallelize
from runtime.parallel.loss import IGNORE_INDEX, TokenMeanLoss, shift_labels
from runtime.parallel.mesh import build_device_mesh, dp_cp_mesh
from runtime.parallel.pipeline import stage_layer_ranges
from runtime.parallel.tensor_parallel import shard_dim
from runtime.parallel.train_step import forward_backward, shard_batch
from runtime.parallel.weight_sync import full_named_tensors, reshard_for_tp

LR = 1e-3
ADAM_EPS = 1e-6
# Tolerances against the single-process run. Only the order of fp32 additions differs
# (TP partial sums, FSDP reduce-scatter, micro-batch accumulation, all-to-all reordering,
# different matmul blocking for smaller batches). fp32 unit roundoff is 6e-8; gradients of
# this model are at most ~1e-1 and the observed worst difference is ~6e-8, so:
GRAD_RTOL, GRAD_ATOL = 1e-4, 2e-7
LOSS_RTOL = 1e-5  # loss ~4.19 summed over 20 tokens: fp32 rounding ~1e-7 relative
# A first AdamW step moves a weight by lr * g / (|g| + eps) (bias-corrected m = g, v = g^2,
# Loshchilov & Hutter 2019, Alg. 2); its slope in g peaks at lr / (4 eps) (at |g| = eps), so a
# gradient error of GRAD_ATOL moves a weight by at most LR * GRAD_ATOL / (4 * ADAM_EPS) = 5e-5.
PARAM_ATOL = LR * GRAD_ATOL / (4 * ADAM_EPS)


def tiny_config(kind: str = "dense"):
    """Qwen2 (``dense``; ``dense-tied``: the LM head is the embedding) or Qwen3-MoE config: hidden 32,
    4 layers, 4 heads / 2 KV heads, vocab 64."""
    common = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=64, tie_word_embeddings=kind == "dense-tied",
    )
    if kind == "moe":
        config = Qwen3MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, norm_topk_prob=True,
        )
    else:
        config = Qwen2Config(**common, intermediate_size=48)
    config._attn_implementation = "sdpa"
    return config


def build_model(kind: str, state: dict | None = None):
    torch.manual_seed(0)
    config = tiny_config(kind)
    model = (Qwen3MoeForCausalLM if kind == "moe" else Qwen2ForCausalLM)(config)
    if state is not None:
        model.load_state_dict(state)
    return model.train()


def tiny_batch(batch: int = 4, seq: int = 8) -> dict[str, torch.Tensor]:
    """Right-padded batch: 2 prompt tokens, then a response; row ``i`` has ``i`` padding tokens at the end."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 64, (batch, seq), generator=generator)
    attention_mask = torch.ones(batch, seq, dtype=torch.int64)
    loss_mask = torch.zeros(batch, seq, dtype=torch.int64)
    for row in range(batch):
        valid = seq - row
        attention_mask[row, valid:] = 0
        input_ids[row, valid:] = 0
        loss_mask[row, 2:valid] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": shift_labels(input_ids, loss_mask)}


def reference_step(kind: str, state: dict, batch: dict) -> dict:
    """One process: token-mean loss, gradients, and weights after one AdamW step."""
    torch.set_num_threads(1)
    model = build_model(kind, state)
    loss_fn = TokenMeanLoss()
    loss_fn.n_global_tokens = int((batch["labels"] != IGNORE_INDEX).sum())
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    loss = loss_fn(logits, batch["labels"])
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS).step()
    return {"loss": loss.item(), "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def parallel_step(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Worker: for each case, parallelize, one forward/backward, gather grads, AdamW step, gather weights."""
    results = []
    for case in cases:
        strategy: ParallelStrategy = case["strategy"]
        mesh = build_device_mesh(strategy, "cpu")
        model = build_model(case["kind"], case["state"])
        pm = parallelize(model, strategy, mesh, case.get("config", ParallelConfig()))
        input_ids, labels = shard_batch(pm, case["batch"]["input_ids"], case["batch"]["labels"])
        loss = forward_backward(pm, input_ids, labels)
        grads = dict(full_named_tensors(pm.module, grads=True))
        torch.optim.AdamW(pm.module.parameters(), lr=LR, eps=ADAM_EPS).step()
        params = dict(full_named_tensors(pm.module))
        groups = {"tp": mesh["tp"].mesh.tolist(), "dp_cp": dp_cp_mesh(mesh).mesh.tolist()}
        results.append({"loss": loss, "grads": grads, "params": params, "groups": groups})
    return results


def merged(rank_results: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Union over ranks of one case's gathered tensors (pipeline stages hold disjoint parameters)."""
    out: dict[str, torch.Tensor] = {}
    for result in rank_results:
        out |= result[key]
    return out


def assert_matches_reference(rank_results: list[dict], reference: dict) -> None:
    """Loss, every gradient and every weight after AdamW equal the single-process run (tolerances above)."""
    for result in rank_results:
        assert result["loss"] == pytest.approx(reference["loss"], rel=LOSS_RTOL)
    grads, params = merged(rank_results, "grads"), merged(rank_results, "params")
    assert sorted(grads) == sorted(reference["grads"])
    assert sorted(params) == sorted(reference["params"])
    for name, expected in reference["grads"].items():
        torch.testing.assert_close(grads[name], expected, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=lambda m: f"grad {name}: {m}")
    for name, expected in reference["params"].items():
        torch.testing.assert_close(params[name], expected, rtol=0, atol=PARAM_ATOL, msg=lambda m: f"weight {name}: {m}")


def test_shift_labels_aligns_next_token_and_masks():
    input_ids = torch.tensor([[5, 6, 7, 8]])
    loss_mask = torch.tensor([[0, 0, 1, 1]])
    # position t holds input_ids[t+1] where loss_mask[t+1] is set: t=0 -> mask[1]=0 -> ignored,
    # t=1 -> 7, t=2 -> 8, t=3 -> last position, ignored.
    assert shift_labels(input_ids, loss_mask).tolist() == [[IGNORE_INDEX, 7, 8, IGNORE_INDEX]]


def test_token_mean_loss_divides_by_the_global_count():
    # uniform logits over 4 classes: each token costs log(4); 2 valid tokens here, 8 in the whole step
    logits = torch.zeros(1, 3, 4)
    labels = torch.tensor([[1, IGNORE_INDEX, 2]])
    loss_fn = TokenMeanLoss()
    loss_fn.n_global_tokens = 8
    assert loss_fn(logits, labels).item() == pytest.approx(2 * torch.log(torch.tensor(4.0)).item() / 8)


def test_token_mean_loss_requires_the_global_count():
    with pytest.raises(RuntimeError, match="n_global_tokens"):
        TokenMeanLoss()(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.int64))


def test_stage_layer_ranges_follow_the_plan():
    assert stage_layer_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layer_ranges(8, 2, [3, 5]) == [range(0, 3), range(3, 8)]
    with pytest.raises(ValueError, match="summing to 8"):
        stage_layer_ranges(8, 2, [3, 4])


def test_reshard_for_tp_cuts_along_the_plan_dimension():
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.arange(8.0).reshape(4, 2),  # column-parallel: rows
        "model.layers.0.self_attn.o_proj.weight": torch.arange(8.0).reshape(2, 4),  # row-parallel: columns
        "model.norm.weight": torch.ones(2),  # replicated
    }
    shards = reshard_for_tp(full, tp_rank=1, tp_size=2)
    assert shards["model.layers.0.self_attn.q_proj.weight"].tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert shards["model.layers.0.self_attn.o_proj.weight"].tolist() == [[2.0, 3.0], [6.0, 7.0]]
    assert shards["model.norm.weight"].tolist() == [1.0, 1.0]
    assert shard_dim("model.layers.3.mlp.down_proj.weight") == 1
    with pytest.raises(ValueError, match="q_proj.weight: dimension 0 of size 4 is not divisible by tp=3"):
        reshard_for_tp(full, tp_rank=0, tp_size=3)
