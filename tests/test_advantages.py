"""Advantage estimators against values computed by hand (arithmetic in the comments)."""

import math

import pytest
import torch

from areal_flow.algorithms.advantages import (
    ESTIMATORS,
    compute_advantages,
    dr_grpo,
    grpo,
    lite_ppo,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
)
from areal_flow.algorithms.returns import gae, multi_turn, token_rewards

# Batch used by the group estimators: 4 groups of unequal size.
#   group 7 (size 2): rewards [1, 0]
#   group 3 (size 3): rewards [0, 1, 2]
#   group 9 (size 1): reward  [5]        (singleton)
#   group 4 (size 3): rewards [0.1]*3    (all equal, do not cancel exactly in float32)
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 5.0, 0.1, 0.1, 0.1])
GROUPS = torch.tensor([7, 7, 3, 3, 3, 9, 4, 4, 4])
# response lengths 2,1,3,2,1,2,1,0 (empty response),3 in a [9, 5] batch, prompt at column 0
LENGTHS = [2, 1, 3, 2, 1, 2, 1, 0, 3]


def _mask(lengths, seq=5, prompt=1):
    m = torch.zeros(len(lengths), seq, dtype=torch.long)
    for i, n in enumerate(lengths):
        m[i, prompt : prompt + n] = 1
    return m


MASK = _mask(LENGTHS)


def _per_seq(adv, mask):
    """The (single) advantage on each row's response tokens; also checks it is constant
    on valid tokens and exactly 0 elsewhere."""
    out = []
    for row, m in zip(adv, mask.bool()):
        assert torch.all(row[~m] == 0)
        vals = row[m]
        if vals.numel():
            assert torch.all(vals == vals[0])
        out.append(float(vals[0]) if vals.numel() else 0.0)
    return torch.tensor(out)


def test_grpo_unbiased_and_population_std_by_hand():
    # group 7: mean 0.5, centred [0.5, -0.5]; sum sq dev 0.5
    #   unbiased std sqrt(0.5/1)=0.707107 -> +-0.5/0.707107 = +-0.707107
    #   population std sqrt(0.5/2)=0.5 -> +-1
    # group 3: mean 1, centred [-1, 0, 1]; sum sq dev 2
    #   unbiased std sqrt(2/2)=1 -> [-1, 0, 1]; population sqrt(2/3)=0.816497 -> +-1.224745
    # group 9 (singleton) and group 4 (all equal): exactly 0
    out = grpo(REWARDS, GROUPS, MASK, eps=1e-6, std_unbiased=True)
    assert out.returns is None
    got = _per_seq(out.advantages, MASK)
    # row 7 has an empty response, so it shows 0 whatever its group's value
    exp = torch.tensor([0.707107, -0.707107, -1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(got, exp, atol=2e-6, rtol=0)
    got = _per_seq(grpo(REWARDS, GROUPS, MASK, eps=0.0, std_unbiased=False).advantages, MASK)
    exp = torch.tensor([1.0, -1.0, -1.224745, 0.0, 1.224745, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(got, exp, atol=1e-6, rtol=0)


def test_grpo_eps_zero_singleton_and_constant_groups_give_exact_zero():
    # std 0 with eps 0 would be 0/0; the guard gives exactly 0
    adv = grpo(REWARDS, GROUPS, MASK, eps=0.0).advantages
    assert torch.isfinite(adv).all()
    assert torch.all(adv[5:] == 0)


@pytest.mark.parametrize("n", [3, 7, 10])
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "lite_ppo", "reinforce_pp_baseline"])
def test_all_equal_rewards_give_exact_zero(name, n):
    # 0.1 is not representable; mean of n copies minus 0.1 need not be 0 in float arithmetic
    rewards = torch.full((n,), 0.1, dtype=torch.float32)
    groups = torch.zeros(n, dtype=torch.long)
    mask = _mask([2] * n, seq=4)
    adv = compute_advantages(name, rewards=rewards, group_ids=groups, loss_mask=mask, eps=1e-6).advantages
    assert torch.isfinite(adv).all()
    assert torch.all(adv == 0)


def test_dr_grpo_by_hand():
    # r - group mean: group 7 [0.5, -0.5]; group 3 [-1, 0, 1]; singleton / equal -> 0
    got = _per_seq(dr_grpo(REWARDS, GROUPS, MASK).advantages, MASK)
    exp = torch.tensor([0.5, -0.5, -1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(got, exp, atol=1e-7, rtol=0)


def test_rloo_by_hand():
    # group 7: 1 - 0 = 1; 0 - 1 = -1
    # group 3: 0 - (1+2)/2 = -1.5; 1 - (0+2)/2 = 0; 2 - (0+1)/2 = 1.5
    # singleton: no other sample -> 0; equal group -> 0
    got = _per_seq(rloo(REWARDS, GROUPS, MASK).advantages, MASK)
    exp = torch.tensor([1.0, -1.0, -1.5, 0.0, 1.5, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(got, exp, atol=1e-6, rtol=0)


def test_lite_ppo_group_mean_batch_std_by_hand():
    # batch [1, 0, 0, 1, 2], groups [a, a, b, b, b]; batch mean 0.8
    # squared deviations 0.04 + 0.64 + 0.64 + 0.04 + 1.44 = 2.8
    # unbiased std sqrt(2.8/4) = 0.836660; population sqrt(2.8/5) = 0.748331
    # group-centred [0.5, -0.5, -1, 0, 1] / std
    r, g = REWARDS[:5], GROUPS[:5]
    m = MASK[:5]
    got = _per_seq(lite_ppo(r, g, m, eps=0.0).advantages, m)
    exp = torch.tensor([0.5, -0.5, -1.0, 0.0, 1.0]) / 0.836660
    torch.testing.assert_close(got, exp, atol=1e-6, rtol=0)
    got = _per_seq(lite_ppo(r, g, m, eps=0.0, std_unbiased=False).advantages, m)
    torch.testing.assert_close(got, torch.tensor([0.5, -0.5, -1.0, 0.0, 1.0]) / 0.748331, atol=1e-6, rtol=0)


def test_singleton_groups_only():
    r = torch.tensor([3.0, -1.0])
    g = torch.tensor([0, 1])
    m = _mask([2, 2], seq=3)
    for name in ("grpo", "dr_grpo", "rloo"):
        adv = compute_advantages(name, rewards=r, group_ids=g, loss_mask=m).advantages
        assert torch.all(adv == 0), name


def test_gae_variable_lengths_holes_padding_truncation():
    gamma, lam = 0.9, 0.8
    nan = float("nan")
    # row 0: response at t=2,3,4, padding at 5 (value NaN, must not enter); reward 1
    #   d4 = 1 - 0.7 = 0.3; d3 = 0.9*0.7 - 0.6 = 0.03; d2 = 0.9*0.6 - 0.5 = 0.04
    #   A4 = 0.3; A3 = 0.03 + 0.72*0.3 = 0.246; A2 = 0.04 + 0.72*0.246 = 0.21712
    #   returns = A + V = [0.71712, 0.846, 1.0]
    # row 1: valid t=1,2,4, t=3 masked (tool output, value 100 ignored); reward 2
    #   d4 = 2 - 1 = 1; d2 = 0.9*1 - 0.5 = 0.4; d1 = 0.9*0.5 - 0 = 0.45
    #   A4 = 1; A2 = 0.4 + 0.72*1 = 1.12; A1 = 0.45 + 0.72*1.12 = 1.2564
    # row 2: empty response -> all 0 (its reward has no token)
    # row 3: truncated, response fills t=1..5 up to the end; V = 0, reward -1:
    #   A5 = -1, A4 = 0.72*-1 = -0.72, A3 = -0.5184, A2 = -0.373248, A1 = -0.26873856
    values = torch.tensor(
        [
            [nan, nan, 0.5, 0.6, 0.7, nan],
            [nan, 0.0, 0.5, 100.0, 1.0, nan],
            [nan, nan, nan, nan, nan, nan],
            [nan, 0.0, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1]])
    rewards = torch.tensor([1.0, 2.0, 5.0, -1.0])
    out = gae(rewards, values, mask, gamma=gamma, lam=lam)
    exp = torch.tensor(
        [
            [0, 0, 0.21712, 0.246, 0.3, 0],
            [0, 1.2564, 1.12, 0, 1.0, 0],
            [0, 0, 0, 0, 0, 0],
            [0, -0.26873856, -0.373248, -0.5184, -0.72, -1.0],
        ]
    )
    torch.testing.assert_close(out.advantages, exp, atol=1e-6, rtol=0)
    exp_ret = torch.tensor(
        [
            [0, 0, 0.71712, 0.846, 1.0, 0],
            [0, 1.2564, 1.62, 0, 2.0, 0],
            [0, 0, 0, 0, 0, 0],
            [0, -0.26873856, -0.373248, -0.5184, -0.72, -1.0],
        ]
    )
    torch.testing.assert_close(out.returns, exp_ret, atol=1e-6, rtol=0)


def test_gae_token_rewards_with_kl_folded():
    # outcome 1 on 3 tokens, kl [0.1, 0.2, 0.3], coef 0.5 -> r = [-0.05, -0.1, 1 - 0.15 = 0.85]
    mask = torch.tensor([[0, 1, 1, 1]])
    tr = token_rewards(torch.tensor([1.0]), mask, kl=torch.tensor([[9.0, 0.1, 0.2, 0.3]]), kl_coef=0.5)
    torch.testing.assert_close(tr, torch.tensor([[0, -0.05, -0.1, 0.85]], dtype=torch.float64))
    # gamma = lam = 1, V = 0: A_t = sum of later rewards = [0.7, 0.75, 0.85]
    out = gae(tr, torch.zeros(1, 4), mask)
    torch.testing.assert_close(out.advantages, torch.tensor([[0, 0.7, 0.75, 0.85]]), atol=1e-6, rtol=0)


def test_gae_rejects_nonfinite_value_on_response_token():
    with pytest.raises(ValueError, match="non-finite"):
        gae(torch.tensor([1.0]), torch.tensor([[0.0, float("nan")]]), torch.tensor([[0, 1]]))


def test_reinforce_pp_by_hand():
    mask = _mask([3, 2], seq=4)
    # no KL, gamma 1: returns row0 [1,1,1], row1 [0,0]; mean 0.6,
    # population var (3*0.16 + 2*0.36)/5 = 0.24, std 0.489898
    # A row0 = 0.4/0.489898 = 0.816497, row1 = -0.6/0.489898 = -1.224745
    out = reinforce_pp(torch.tensor([1.0, 0.0]), mask, eps=0.0)
    torch.testing.assert_close(_per_seq(out.advantages, mask), torch.tensor([0.816497, -1.224745]), atol=1e-6, rtol=0)
    # KL on row0 first token 0.5, coef 1 -> token rewards [-0.5, 0, 1]; returns [0.5, 1, 1]
    # values [0.5, 1, 1, 0, 0]: mean 0.5, deviations [0, .5, .5, -.5, -.5], var 1/5, std 0.447214
    kl = torch.zeros(2, 4)
    kl[0, 1] = 0.5
    out = reinforce_pp(torch.tensor([1.0, 0.0]), mask, kl=kl, kl_coef=1.0, eps=0.0)
    a = 0.5 / math.sqrt(0.2)  # = 1.118034
    exp = torch.tensor([[0, 0, a, a], [0, -a, -a, 0]])
    torch.testing.assert_close(out.advantages, exp, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.returns, torch.tensor([[0, 0.5, 1, 1], [0, 0, 0, 0]]))
    # gamma 0.5, reward 1 at the last of 3 tokens: returns [0.25, 0.5, 1]
    out = reinforce_pp(torch.tensor([1.0]), _mask([3], seq=4), gamma=0.5)
    torch.testing.assert_close(out.returns, torch.tensor([[0, 0.25, 0.5, 1.0]]))


def test_reinforce_pp_baseline_by_hand():
    # groups [0, 0, 1, 1], rewards [1, 0, 3, 3], lengths [3, 2, 1, 1]
    # group-centred rewards [0.5, -0.5, 0, 0] -> token returns 0.5 x3, -0.5 x2, 0 x2
    # mean = (1.5 - 1)/7 = 0.0714286; deviations 0.428571 (x3), -0.571429 (x2), -0.0714286 (x2)
    # squares 3*0.183673 + 2*0.326531 + 2*0.005102 = 1.214286; var /7 = 0.173469; std 0.416496
    # A = 1.028992, -1.371989, -0.171499
    mask = _mask([3, 2, 1, 1], seq=4)
    out = reinforce_pp_baseline(torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.tensor([0, 0, 1, 1]), mask, eps=0.0)
    exp = torch.tensor([1.028992, -1.371989, -0.171499, -0.171499])
    torch.testing.assert_close(_per_seq(out.advantages, mask), exp, atol=2e-6, rtol=0)


def test_reinforce_pp_empty_batch_and_all_masked():
    mask = torch.zeros(2, 3, dtype=torch.long)
    out = reinforce_pp(torch.tensor([1.0, 2.0]), mask)
    assert torch.all(out.advantages == 0)


def test_multi_turn_discounted_returns_by_hand():
    # turn rewards [0, 1, 2], gamma 0.5: G2 = 2; G1 = 1 + 0.5*2 = 2; G0 = 0 + 0.5*2 = 1
    # tokens: turn ids [0,0,0,1,1,2,2,0], mask [0,1,1,0,1,0,1,0] (environment tokens masked)
    # row 1: only 2 turns [1, 0] (third padded with 0): G1 = 0, G0 = 1
    turn_rewards = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 0.0]])
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 0], [0, 0, 1, 1, 0, 0, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 1, 0], [0, 1, 0, 1, 0, 0, 0, 0]])
    out = multi_turn(turn_rewards, ids, mask, gamma=0.5)
    exp = torch.tensor([[0, 1, 1, 0, 2, 0, 2, 0], [0, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    torch.testing.assert_close(out.advantages, exp)
    with pytest.raises(ValueError, match="turn_ids"):
        multi_turn(turn_rewards, ids + 5, mask)


def test_compute_advantages_dispatch():
    assert set(ESTIMATORS) == {
        "gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "lite_ppo", "multi_turn",
    }
    # extra arguments other estimators take are ignored: the trainer can pass a superset
    out = compute_advantages(
        "dr_grpo", rewards=REWARDS, group_ids=GROUPS, loss_mask=MASK, values=torch.zeros(9, 5), gamma=0.9, eps=1e-3
    )
    torch.testing.assert_close(out.advantages, dr_grpo(REWARDS, GROUPS, MASK).advantages)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'nope'.*'grpo'"):
        compute_advantages("nope", rewards=REWARDS)
    with pytest.raises(TypeError, match="group_id"):
        compute_advantages("grpo", rewards=REWARDS, group_id=GROUPS, loss_mask=MASK)
    with pytest.raises(TypeError, match="needs.*values"):
        compute_advantages("gae", rewards=REWARDS, loss_mask=MASK)


def test_input_validation():
    with pytest.raises(ValueError, match="non-finite reward at batch index \\[1\\]"):
        grpo(torch.tensor([0.0, math.inf]), torch.tensor([0, 0]), _mask([1, 1]))
    with pytest.raises(ValueError, match="group_ids"):
        grpo(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0]), _mask([1, 1]))
    with pytest.raises(ValueError, match="rewards must be"):
        rloo(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0, 0, 0]), _mask([1, 1]))


def test_estimator_knobs_work_for_every_estimator():
    kw = {"gamma": 0.9, "lam": 0.8, "eps": 1e-6, "std_unbiased": True}  # what an advantage node may pass
    batch = dict(
        rewards=REWARDS, group_ids=GROUPS, loss_mask=MASK, values=torch.zeros(9, 5),
        turn_rewards=REWARDS[:, None], turn_ids=torch.zeros(9, 5, dtype=torch.long),
    )
    for name in ESTIMATORS:
        adv = compute_advantages(name, **batch, **kw).advantages
        assert adv.shape == MASK.shape and torch.isfinite(adv).all(), name
        assert torch.all(adv[MASK == 0] == 0), name
    # gae, V = 0, row 0 (tokens 1, 2; reward 1): d2 = 1, d1 = 0 -> A2 = 1, A1 = 0.9*0.8*1 = 0.72
    adv = compute_advantages("gae", **batch, **kw).advantages
    torch.testing.assert_close(adv[0, 1:3], torch.tensor([0.72, 1.0]))
