"""Micro-batches of a step: the packed layout by hand, token-budget grouping by hand, and
packed / token-budget updates equal to the padded reference (same loss, same gradient)."""

import pytest
import torch
from test_algorithms import VARIANTS, make_batch, run, tiny_model

from areal_flow.algorithms.config import LOSS_AGG_MODES, LossConfig
from areal_flow.algorithms.micro_batches import plan_micro_batches, split_to_count, trimmed_width
from areal_flow.models.logprobs import token_logprobs
from areal_flow.models.packed_attention import packed_attention


def _mask(lengths, width):
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return mask


def test_packed_layout_by_hand():
    # Rows of 3, 1 and 2 tokens (T = 4) packed into one row of 3 + 1 + 2 = 6 tokens.
    ids = torch.tensor([[11, 12, 13, 0], [21, 0, 0, 0], [31, 32, 0, 0]])
    (mb,) = plan_micro_batches(_mask([3, 1, 2], 4), micro_batch_size=3, pack=True)
    inputs = mb.model_inputs(ids, _mask([3, 1, 2], 4))
    assert inputs["input_ids"].tolist() == [[11, 12, 13, 21, 31, 32]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]
    assert inputs["attention_mask"] is None
    assert mb.tokens == 6 and mb.width == 3
    # Each (row, column) maps back to its packed position; columns after a row's length are not real.
    index, real = mb.token_index(torch.device("cpu"))
    assert index.tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    assert real.tolist() == [[True, True, True], [True, False, False], [True, True, False]]
    assert [(g.start, g.end, g.branches) for g in mb.attention_groups()] == [(0, 3, ()), (3, 4, ()), (4, 6, ())]
    out = torch.full((3, 4), -1.0)
    mb.put(out, mb.take(torch.arange(12.0).view(3, 4)))
    assert out.tolist() == [[0, 1, 2, -1], [4, 5, 6, -1], [8, 9, 10, -1]]


def test_padded_layout_keeps_rows_and_trims_columns():
    mbs = plan_micro_batches(_mask([3, 1, 2], 5), micro_batch_size=2)
    assert [mb.rows for mb in mbs] == [(0, 1), (2,)]
    assert [mb.width for mb in mbs] == [3, 2] and [mb.tokens for mb in mbs] == [6, 2]
    inputs = mbs[0].model_inputs(torch.ones(3, 5, dtype=torch.long), _mask([3, 1, 2], 5))
    assert inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]] and inputs["position_ids"] is None
    assert trimmed_width(_mask([0, 0], 5)) == 5 and trimmed_width(_mask([2, 4], 5)) == 4


def test_token_budget_first_fit_decreasing_by_hand():
    lengths = [5, 2, 4, 3, 1]
    # Packed, budget 6, longest first: 5 -> A; 4 -> B (5+4 > 6); 3 -> C (8, 7 > 6);
    # 2 -> B (4+2 = 6); 1 -> A (5+1 = 6).  A = rows (0, 4), B = (2, 1), C = (3,).
    packed = plan_micro_batches(_mask(lengths, 6), micro_batch_size=1, max_tokens=6, pack=True)
    assert [mb.rows for mb in packed] == [(0, 4), (2, 1), (3,)]
    assert [mb.tokens for mb in packed] == [6, 6, 3]
    # Padded, budget 8 (cost = rows x longest row): 5 -> A; 4 -> B (2*5 > 8); 3 -> B (2*4 = 8);
    # 2 -> C (2*5, 3*4 > 8); 1 -> C (2*2 = 4).
    padded = plan_micro_batches(_mask(lengths, 6), micro_batch_size=1, max_tokens=8)
    assert [mb.rows for mb in padded] == [(0,), (2, 3), (1, 4)]
    assert [mb.tokens for mb in padded] == [5, 8, 4]


def test_split_to_count_by_hand():
    # padded, budget 8: A = (0,) 5 tokens, B = (2, 3) 2 x 4 = 8, C = (1, 4) 2 x 2 = 4 (test above)
    mbs = plan_micro_batches(_mask([5, 2, 4, 3, 1], 6), micro_batch_size=1, max_tokens=8)
    # 4 micro-batches (another DP rank's count): B computes the most of those with 2 rows -> (2,), (3,) in its place
    four = split_to_count(mbs, 4)
    assert [mb.rows for mb in four] == [(0,), (2,), (3,), (1, 4)]
    assert [mb.tokens for mb in four] == [5, 4, 3, 4]  # none over the budget of 8
    # 5: only C has 2 rows left
    assert [mb.rows for mb in split_to_count(mbs, 5)] == [(0,), (2,), (3,), (1,), (4,)]
    assert split_to_count(mbs, 3) == mbs
    with pytest.raises(ValueError, match="cannot split 5 rows into 6 micro-batches"):
        split_to_count(mbs, 6)


def test_bad_micro_batch_input_is_named():
    with pytest.raises(ValueError, match=r"row 1 has 5 tokens.*train.max_tokens_per_micro_batch=4"):
        plan_micro_batches(_mask([2, 5], 6), micro_batch_size=1, max_tokens=4)
    left_padded = torch.tensor([[1, 1, 1], [0, 1, 1]])
    with pytest.raises(ValueError, match="row 1 has padding"):
        plan_micro_batches(left_padded, micro_batch_size=2, pack=True)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=-1"):
        plan_micro_batches(_mask([2], 3), micro_batch_size=1, max_tokens=-1)
    with pytest.raises(ValueError, match="need position_ids"):
        token_logprobs(tiny_model(), torch.ones(1, 3, dtype=torch.long), None)


def test_packed_logprobs_equal_padded_ones():
    torch.set_num_threads(1)
    model = tiny_model()
    batch = make_batch(model)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        padded = token_logprobs(model, ids, attn)
        (mb,) = plan_micro_batches(attn, micro_batch_size=5, pack=True)
        with packed_attention(model, mb.attention_groups()):
            flat = token_logprobs(model, **mb.model_inputs(ids, attn))
        index, real = mb.token_index(ids.device)
        packed = flat[0][index] * real
    valid = attn.bool().clone()
    valid[:, 0] = False  # a packed row's first token follows the previous sequence: never a valid log-prob
    width = packed.shape[1]
    torch.testing.assert_close(packed[valid[:, :width]], padded[:, :width][valid[:, :width]], atol=1e-5, rtol=1e-5)


def assert_same_update(reference, d_ref, metrics, deltas, label):
    """An update (``test_algorithms.run``'s metrics and parameter deltas) equals the reference one:
    the loss and its metrics, and every parameter's change (a gradient was there to compare)."""
    for key in ("loss", "policy_loss", "clip_frac", "entropy", "importance_weight_mean", "kl_behavior_current"):
        assert metrics[key] == pytest.approx(reference[key], abs=1e-5, rel=1e-4), (key, label)
    assert reference["grad_norm"] > 0
    for a, b in zip(d_ref, deltas):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", ["ppo", "decoupled", "kl_entropy"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_packed_and_token_budget_updates_equal_padded(mode, variant):
    torch.set_num_threads(1)
    model = tiny_model()
    batch = make_batch(model, noise=0.3)
    batch["ref_logprobs"] = batch["behavior_logprobs"] - 0.05
    cfg = LossConfig(loss_agg_mode=mode, **VARIANTS[variant])
    reference, d_ref, _ = run(cfg, model, batch, mbs=5)  # the padded computation, one micro-batch
    # Rows hold 5, 5, 3, 9 and 3 tokens: a budget of 12 tokens makes 3 micro-batches either way.
    for kw in (dict(pack_sequences=True), dict(pack_sequences=True, max_tokens_per_micro_batch=12),
               dict(max_tokens_per_micro_batch=12)):
        assert_same_update(reference, d_ref, *run(cfg, model, batch, mbs=5, **kw)[:2], kw)


def test_config_keys_reach_the_trainer_and_bad_values_are_named():
    from areal_flow.config import ConfigError
    from areal_flow.config_load import load_config
    from compiler.executable import ExecutableError, NodeFacts, check_node
    from compiler.strategy import ParallelStrategy

    cfg = load_config(overrides=["train.max_tokens_per_micro_batch=512", "train.pack_sequences=true"])
    assert cfg.train.max_tokens_per_micro_batch == 512 and cfg.train.pack_sequences is True
    with pytest.raises(ConfigError, match="train.max_tokens_per_micro_batch=-3"):
        load_config(overrides=["train.max_tokens_per_micro_batch=-3"])
    facts = dict(rows=8, token_budget=512)
    with pytest.raises(ExecutableError, match="max_tokens_per_micro_batch=512 with pp=2"):  # one micro-batch shape
        check_node(NodeFacts("train_step", "training", ParallelStrategy.parse("p2"), **facts))
    # dp ranks even out their micro-batch counts (split_to_count): accepted
    check_node(NodeFacts("train_step", "training", ParallelStrategy.parse("d2"), **facts))


def test_a_run_trains_with_packed_token_budget_micro_batches(tmp_path, warm_cache):
    import json
    from pathlib import Path

    from areal_flow.cli import load_flow
    from areal_flow.config_load import load_config
    from runs import records
    from areal_flow.cli.run import run_experiment

    repo = Path(__file__).resolve().parents[1]
    torch.set_num_threads(1)
    cfg = load_config(repo / "graphs" / "arith_grpo.yaml",
                      ["train.steps=2", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10",
                       "eval.enabled=false", "train.pack_sequences=true", "train.max_tokens_per_micro_batch=40",
                       f"out_dir={tmp_path}", "name=packed"])
    run_experiment(load_flow(repo / "graphs" / "arith_grpo.py")(cfg), cfg, show_progress=False)
    plan = json.loads((tmp_path / "packed" / "plan.json").read_text())
    (train,) = [n for n in plan["nodes"] if n["op"] == "train_step"]
    assert train["attrs"]["pack_sequences"] is True and train["attrs"]["max_tokens_per_micro_batch"] == 40
    assert len(records(tmp_path / "packed")) == 2 * 2 * 4


def test_packed_attention_stays_inside_each_sequence():
    from areal_flow.models.packed_attention import NAME, PackedGroup, packed_sdpa

    torch.set_num_threads(1)
    model = tiny_model()
    seqs = [[3, 5, 7], [4], [9, 2, 6, 8]]  # each alone is the reference: nothing may leak between them
    ids = torch.tensor([sum(seqs, [])])
    positions = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])
    groups = (PackedGroup(0, 3), PackedGroup(3, 4), PackedGroup(4, 8))
    with torch.no_grad(), packed_attention(model, groups):
        assert model.config._attn_implementation == NAME  # the layers run packed_sdpa, not transformers' mask
        packed = token_logprobs(model, ids, None, position_ids=positions)[0]
    assert model.config._attn_implementation == "sdpa"  # restored after the context
    start = 0
    for seq in seqs:
        with torch.no_grad():
            alone = token_logprobs(model, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))[0]
        torch.testing.assert_close(packed[start + 1 : start + len(seq)], alone[1:], atol=1e-5, rtol=1e-5)
        start += len(seq)
    q = torch.zeros(2, 4, 3, 8)
    with pytest.raises(ValueError, match="one packed row"):
        packed_sdpa(model, q, q, q, None)  # outside packed_attention: no groups
    with packed_attention(model, (PackedGroup(0, 3),)), pytest.raises(ValueError, match="2 rows of 3"):
        packed_sdpa(model, q, q, q, None)
    with packed_attention(model, (PackedGroup(0, 2),)), pytest.raises(ValueError, match="groups ending at 2"):
        packed_sdpa(model, q[:1], q[:1], q[:1], None)


def test_packed_attention_on_cpu_attends_in_fp32_under_autocast():
    # bf16 autocast (the trainer's model.dtype=bfloat16) would run SDPA in bf16; on CPU the packed
    # attention runs it in fp32 instead: the reference is softmax(q k^T / sqrt(d) + causal) v per
    # group (Vaswani et al. 2017, eq. 1), each query head h reading key/value head h // 2 (GQA).
    from areal_flow.models.packed_attention import PackedGroup, packed_sdpa

    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 7, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g)
    groups = (PackedGroup(0, 3), PackedGroup(3, 7))

    def by_hand(q, k, v):
        out = torch.zeros(1, 7, 4, 8, dtype=torch.float64)
        for grp in groups:
            s, e = grp.start, grp.end
            for h in range(4):
                scores = q[0, h, s:e].double() @ k[0, h // 2, s:e].double().T / 8 ** 0.5
                scores = scores.masked_fill(torch.ones(e - s, e - s).triu(1).bool(), float("-inf"))
                out[0, s:e, h] = scores.softmax(-1) @ v[0, h // 2, s:e].double()
        return out

    q.requires_grad_(True)
    with packed_attention(model, groups), torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = packed_sdpa(model, q, k, v, None)
        out16, _ = packed_sdpa(model, q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    with packed_attention(model, groups):  # 16-bit inputs without autocast: attended in fp32 too
        bare16, _ = packed_sdpa(model, q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    assert out.dtype == torch.float32 and out16.dtype == bare16.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), by_hand(q, k, v), atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad(out.sum(), q)  # the backward ran in fp32 as well
    q64 = q.detach().double().requires_grad_(True)
    (grad64,) = torch.autograd.grad(by_hand(q64, k, v).sum(), q64)
    torch.testing.assert_close(grad.double(), grad64, atol=1e-5, rtol=1e-5)
    q = q.detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what autocast alone runs: bf16 SDPA, ~1e-2 off here
        plain = torch.nn.functional.scaled_dot_product_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3],
                                                                 is_causal=True, enable_gqa=True)
    assert (plain.double().transpose(1, 2) - by_hand(q, k, v)[:, :3]).abs().max() > 1e-3
    exact16 = by_hand(q.bfloat16(), k.bfloat16(), v.bfloat16())  # bf16 inputs, fp32 arithmetic, one rounding
    for half in (out16, bare16):  # at most one bf16 step from the exact result rounded once
        torch.testing.assert_close(half.double(), exact16.bfloat16().double(), atol=0, rtol=2 ** -7)


def test_packed_update_with_activation_checkpointing_equals_padded():
    # Checkpointing recomputes each layer's forward during backward: the recomputed attention
    # must still stay inside each packed sequence.
    torch.set_num_threads(1)
    model = tiny_model().train()
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    batch = make_batch(model, noise=0.3)
    cfg = LossConfig(**VARIANTS["ppo"])
    reference, d_ref, _ = run(cfg, model, batch, mbs=5)
    m, d, _ = run(cfg, model, batch, mbs=5, pack_sequences=True, max_tokens_per_micro_batch=12)
    assert m["loss"] == pytest.approx(reference["loss"], abs=1e-5, rel=1e-4)
    for a, b in zip(d_ref, d):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
