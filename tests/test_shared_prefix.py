"""Shared prefixes of packed micro-batches: the clustering by hand and against every cut, the
layout and attention mask by hand, and log-probs / updates equal to each row run whole."""

import itertools
import random

import pytest
import torch
from test_algorithms import VARIANTS, run, tiny_model
from test_micro_batches import assert_same_update

from areal_flow.algorithms.config import LOSS_AGG_MODES, LossConfig
from areal_flow.algorithms.model_runner import ModelRunner
from areal_flow.algorithms.micro_batches import MicroBatch, plan_micro_batches, split_to_count
from areal_flow.algorithms.shared_prefix import common_prefix, share_prefixes
from areal_flow.models.logprobs import token_logprobs
from areal_flow.models.packed_attention import PackedGroup, group_mask, packed_attention

# Three GRPO-like groups: prompts [1, 5, 6, 7], [1, 5, 8], [2, 9, 9, 4]; row 1's response starts
# like row 0's (they share one response token more), row 6 is row 5's prompt + one token.
ROWS = [
    [1, 5, 6, 7, 10, 11, 12],
    [1, 5, 6, 7, 10, 13],
    [1, 5, 6, 7, 14],
    [1, 5, 8, 15, 16],
    [1, 5, 8, 17, 18, 19, 3],
    [2, 9, 9, 4, 12, 12],
    [2, 9, 9, 4, 13],
]


def _batch(rows, width=8):
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, toks in enumerate(rows):
        ids[r, : len(toks)] = torch.tensor(toks)
        attn[r, : len(toks)] = 1
    return ids, attn


def test_share_prefixes_by_hand():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
    order, shared = share_prefixes(ROWS)
    # In token order the rows are 0, 1, 2, 3, 4, 5, 6; neighbours share 5, 4, 2, 3, 0, 4 tokens.
    # Rows 0..4 as one cluster (root 0): 7 + (6-5) + (5-4) + (5-2) + (7-2) = 17 tokens; cut as
    # {0, 1, 2} + {3, 4}: 7 + 1 + 1 + 5 + (7-3) = 18. Rows 5, 6: 6 + (5-4) = 7 (nothing in
    # common with row 4). So 24 tokens of 41.
    assert order == [0, 1, 2, 3, 4, 5, 6] and shared == [0, 5, 4, 2, 2, 0, 4]
    # identical rows: every branch keeps its last token; a lone row or none
    assert share_prefixes([[3, 4], [3, 4], [3, 4]]) == ([0, 1, 2], [0, 1, 1])
    assert share_prefixes([[7]]) == ([0], [0]) and share_prefixes([]) == ([], [])


def _cost(rows, cluster):
    root = rows[cluster[0]]
    return len(root) + sum(len(rows[k]) - max(0, min(common_prefix(root, rows[k]), len(rows[k]) - 1))
                           for k in cluster[1:])


def test_share_prefixes_is_the_cheapest_cut_of_the_sorted_rows():
    rng = random.Random(0)
    for _ in range(40):
        rows = [[rng.choice([1, 2]) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 7))]
        order, shared = share_prefixes(rows)
        got = sum(len(rows[r]) - q for r, q in zip(order, shared))
        srt = sorted(range(len(rows)), key=lambda r: rows[r])
        best = min(  # every way to cut the sorted rows into consecutive clusters
            sum(_cost(rows, srt[a:b]) for a, b in zip((0, *cuts), (*cuts, len(srt))))
            for k in range(len(srt)) for cuts in itertools.combinations(range(1, len(srt)), k))
        assert got == best, rows
        for r, q in zip(order, shared):  # what a row takes from its root is really there
            if q == 0:
                root = rows[r]
            assert rows[r][:q] == root[:q] and q < max(len(rows[r]), 1)


def test_shared_layout_and_mask_by_hand():
    ids, attn = _batch(ROWS[5:])  # [2,9,9,4,12,12] and [2,9,9,4,13]
    (mb,) = plan_micro_batches(attn, micro_batch_size=2, pack=True, input_ids=ids)
    assert mb.rows == (0, 1) and mb.shared == (0, 4) and mb.tokens == 7
    inputs = mb.model_inputs(ids, attn)
    assert inputs["input_ids"].tolist() == [[2, 9, 9, 4, 12, 12, 13]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 4]]
    index, real = mb.token_index(torch.device("cpu"))
    assert index.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 6, 0]]
    assert real[1].tolist() == [True] * 5 + [False]
    (group,) = mb.attention_groups()
    assert group == PackedGroup(0, 7, ((6, 4),))
    # the branch token (position 6 of the row) sees the prompt's 4 tokens and itself, not 12, 12
    expected = torch.tril(torch.ones(7, 7, dtype=torch.bool))
    expected[6] = torch.tensor([1, 1, 1, 1, 0, 0, 1], dtype=torch.bool)
    assert torch.equal(group_mask(group, torch.device("cpu")), expected)
    # without input_ids nothing is shared
    (plain,) = plan_micro_batches(attn, micro_batch_size=2, pack=True)
    assert plain.shared == () and plain.tokens == 11


def test_split_makes_an_orphan_branch_a_root():
    ids, attn = _batch(ROWS)
    (mb,) = plan_micro_batches(attn, micro_batch_size=7, pack=True, input_ids=ids)
    first, rest = mb.split(2)
    assert first.rows == (0, 1) and first.shared == (0, 5)
    # row 2 lost its root (row 0): it runs whole; rows 3 and 4 share [1, 5] with it instead
    assert rest.rows == (2, 3, 4, 5, 6) and rest.shared == (0, 2, 2, 0, 4) and rest.tokens == 5 + 3 + 5 + 6 + 1
    parts = split_to_count([mb], 3)
    assert sorted(r for p in parts for r in p.rows) == list(range(7))
    torch.set_num_threads(1)
    model = tiny_model()
    whole = ModelRunner(model).logprobs([mb], ids, attn, temperature=1.0)
    torch.testing.assert_close(ModelRunner(model).logprobs(parts, ids, attn, temperature=1.0), whole,
                               atol=1e-5, rtol=1e-5)


def test_bad_shared_lengths_are_named():
    with pytest.raises(ValueError, match="needs the packed layout"):
        MicroBatch((0, 1), (3, 3), False, (0, 2))
    with pytest.raises(ValueError, match="0 on the first row"):
        MicroBatch((0, 1), (3, 3), True, (1, 0))
    with pytest.raises(ValueError, match="row 4 .* shares 3 tokens"):
        MicroBatch((3, 4), (3, 3), True, (0, 3))  # a branch keeps one token of its own
    with pytest.raises(ValueError, match="root of 2"):
        MicroBatch((3, 4), (2, 5), True, (0, 3))


def test_shared_logprobs_equal_each_row_alone():
    torch.set_num_threads(1)
    model = tiny_model()
    ids, attn = _batch(ROWS)
    (mb,) = plan_micro_batches(attn, micro_batch_size=7, pack=True, input_ids=ids)
    assert mb.tokens == 24  # of 41
    packed = ModelRunner(model).logprobs([mb], ids, attn, temperature=0.7, scored_from=1)
    for r, toks in enumerate(ROWS):
        n = len(toks)
        with torch.no_grad():
            alone = token_logprobs(model, ids[r:r + 1, :n], attn[r:r + 1, :n], temperature=0.7)[0]
        torch.testing.assert_close(packed[r, 1:n], alone[1:n], atol=1e-5, rtol=1e-5)
        assert packed[r, 0] == 0 and not packed[r, n:].any()
    # scored_from = 5: columns before it hold 0, the rest the same values
    late = ModelRunner(model).logprobs([mb], ids, attn, temperature=0.7, scored_from=5)
    assert not late[:, :5].any()
    torch.testing.assert_close(late[:, 5:], packed[:, 5:])


def _grpo_batch(model):
    ids, attn = _batch(ROWS)
    loss_mask = torch.zeros_like(attn)
    for r, p in enumerate([4, 4, 4, 3, 3, 4, 4]):  # the prompts above
        loss_mask[r, p : len(ROWS[r])] = 1
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        lp = token_logprobs(model, ids, attn)
    behavior = torch.where(loss_mask.bool(), lp + 0.3 * torch.randn(lp.shape, generator=g), 0.0)
    adv = torch.tensor([1.0, -0.5, 0.2, 0.7, -0.7, 0.4, -0.4])[:, None] * loss_mask
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask, "behavior_logprobs": behavior,
            "advantages": adv, "ref_logprobs": behavior - 0.05}


@pytest.mark.parametrize("variant", ["ppo", "decoupled", "kl_entropy"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_shared_prefix_update_equals_padded(mode, variant):
    torch.set_num_threads(1)
    model = tiny_model()
    batch = _grpo_batch(model)
    cfg = LossConfig(loss_agg_mode=mode, **VARIANTS[variant])
    reference, d_ref, _ = run(cfg, model, batch, mbs=7)  # padded, every row whole
    # one micro-batch; three (groups cut apart); a token budget of 12 (clusters cut, test below)
    for kw in (dict(mbs=7), dict(mbs=3), dict(mbs=1, max_tokens_per_micro_batch=12)):
        assert_same_update(reference, d_ref, *run(cfg, model, batch, pack_sequences=True, shared_prefix=True, **kw)[:2],
                           kw)


def test_token_budget_keeps_sharing_rows_together_by_hand():
    ids, attn = _batch(ROWS)
    # Clusters (test above): rows 0..4 compute 7, 1, 1, 3, 5 tokens; rows 5, 6 compute 6, 1.
    # Budget 12: the first cluster is cut after row 2 (7 + 1 + 1 = 9; + 3 = 12 fits; + 5 does
    # not) -> pieces [0, 1, 2, 3] (12) and [4] (7 tokens, a root now); [5, 6] (7).
    # First fit, largest first: 12 -> A; 7 (row 4) -> B; 7 (rows 5, 6) -> C (7 + 7 > 12).
    mbs = plan_micro_batches(attn, micro_batch_size=1, max_tokens=12, pack=True, input_ids=ids)
    assert [mb.rows for mb in mbs] == [(0, 1, 2, 3), (4,), (5, 6)]
    assert [mb.shared for mb in mbs] == [(0, 5, 4, 2), (), (0, 4)]
    assert [mb.tokens for mb in mbs] == [12, 7, 7]
    # budget 20: [0..4] is 17 tokens -> A; [5, 6] 7 -> B (17 + 7 > 20)
    mbs = plan_micro_batches(attn, micro_batch_size=1, max_tokens=20, pack=True, input_ids=ids)
    assert [mb.rows for mb in mbs] == [(0, 1, 2, 3, 4), (5, 6)] and [mb.tokens for mb in mbs] == [17, 7]


def test_the_time_model_counts_a_shared_prompt_once():
    # 4 samples a prompt of 8 tokens, 8-token responses: a sequence computes 8 / 4 + 8 = 10 tokens
    # shared, 16 not; the compute floor is n_seq x seq x 3 x (2 N + 2 x layers x seq x heads x
    # head_dim) FLOP (compiler.timing's model) = 2N + 2 x 2 x seq x 2 x 4 = 2N + 32 seq a token, so
    # its ratio is (10 (2N + 320)) / (16 (2N + 512)).
    from areal_flow.config_compile import ClusterConfig, CompileConfig, LengthDistConfig
    from compiler.cost import CostModel
    from compiler.hardware import DeviceSpec
    from compiler.models import ModelSpec
    from compiler.strategy import ParallelStrategy
    from compiler.workload import TRAINING, DeviceTask, Workload

    dense = ModelSpec("dense", n_layers=2, hidden=8, n_heads=2, n_kv_heads=2, head_dim=4, vocab=10, intermediate=16)
    device = DeviceSpec("d", peak_flops=1e12, memory_bytes=1e12, hbm_bandwidth=1e30, intra_node_bandwidth=1e30,
                        inter_node_bandwidth=1e30, host_bandwidth=1e30, collective_latency_s=0.0)
    task = DeviceTask("train_step", "train_step", TRAINING, "policy", dense)
    cfg = CompileConfig(length_dist=LengthDistConfig(kind="fixed", mean=1.0))

    def floor(shared):
        w = Workload("g", (task,), {}, n_sequences=32, prompt_len=8, new_tokens=8, staleness=1, aliases={},
                     data_edges=(), ops={"train_step": "train_step"}, samples_per_prompt=4,
                     shared_prompt_nodes=frozenset({"train_step"} if shared else ()))
        model = CostModel(w, device, ClusterConfig(1, 1, "H100"), cfg)
        return model.trained_seq_len(task, ParallelStrategy()), model.compute_floor(task, 1), model

    (seq_on, on, model), (seq_off, off, _) = floor(True), floor(False)
    assert (seq_on, seq_off) == (10, 16)
    # pp and cp train padded rows (runtime.parallel.rl_runner.right_padded): every prompt counts
    assert model.trained_seq_len(task, ParallelStrategy(pp=2)) == model.trained_seq_len(task, ParallelStrategy(cp=2)) == 16
    n2 = 2 * dense.n_active_params
    assert on / off == pytest.approx(10 * (n2 + 320) / (16 * (n2 + 512)), rel=1e-9)


@pytest.mark.parametrize("knobs, shared", [([], True), (["train.shared_prefix=false"], False),
                                           (["train.pack_sequences=false"], False), (["gen.n_samples=1"], False)])
def test_the_plan_marks_the_policy_train_step_that_shares_prompts(knobs, shared):
    from pathlib import Path

    from areal_flow.cli import load_flow
    from areal_flow.config_load import load_config
    from compiler.program import lower_attrs
    from compiler.workload import build_workload

    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "graphs" / "arith_grpo.yaml", knobs)
    graph = load_flow(repo / "graphs" / "arith_grpo.py")(cfg)
    lower_attrs(graph, cfg)
    w = build_workload(graph, cfg.compile, cfg.train.batch_size)
    assert w.shared_prompt_nodes == (frozenset({w.aliases["train"]}) if shared else frozenset())
