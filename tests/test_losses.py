"""Policy/value losses, KL estimators and entropy against values computed by hand."""

import math

import pytest
import torch

from areal_flow.algorithms.config import LossConfig
from areal_flow.algorithms.kl import kl_penalty
from areal_flow.algorithms.losses import (
    behavior_importance_weight,
    compute_policy_loss,
    gspo_loss,
    m2po_keep_mask,
    m2po_loss,
    ppo_clip_loss,
    sapo_loss,
    token_entropy,
    value_loss,
)


def _lp(log_ratios):
    """(logprobs with grad, old_logprobs) whose difference is ``log_ratios`` ([1, n])."""
    old = torch.full((1, len(log_ratios)), -1.0)
    lp = (old + torch.tensor([log_ratios])).requires_grad_(True)
    return lp, old


def test_ppo_clip_higher_by_hand():
    # eps_low 0.2, eps_high 0.28; loss = max(-A r, -A clip(r, 0.8, 1.28))
    # t0 r=1.5 A=1:  max(-1.5, -1.28) = -1.28   clipped (gradient 0)
    # t1 r=0.5 A=1:  max(-0.5, -0.8)  = -0.5    not clipped (grad -A r = -0.5)
    # t2 r=1.1 A=-1: max(1.1, 1.1)    = 1.1     not clipped (grad -A r = 1.1)
    # t3 r=1   A=-2: 2                          not clipped (grad 2)
    # t4 r=0.5 A=-1: max(0.5, 0.8)    = 0.8     clipped
    # t5 masked (NaN old log-prob must not leak)
    lp, old = _lp([math.log(1.5), math.log(0.5), math.log(1.1), 0.0, math.log(0.5), 0.0])
    old[0, 5] = float("nan")
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0, -1.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    out = ppo_clip_loss(lp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    torch.testing.assert_close(out.loss, torch.tensor([[-1.28, -0.5, 1.1, 2.0, 0.8, 0.0]]))
    assert out.clipped.tolist() == [[True, False, False, False, True, False]]
    out.loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.5, 1.1, 2.0, 0.0, 0.0]]))


def test_ppo_dual_clip_by_hand():
    # c = 3. t0 r=5 A=-1: max(5, 1.28) = 5 > -c A = 3 -> 3 (dual-clipped, gradient 0)
    #        t1 r=2 A=-1: max(2, 1.2) = 2 < 3 -> 2;  t2 r=5 A=+1: max(-5, -1.2) = -1.2 (dual clip only for A<0)
    lp, old = _lp([math.log(5.0), math.log(2.0), math.log(5.0)])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    out = ppo_clip_loss(lp, old, adv, torch.ones(1, 3), clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=3.0)
    torch.testing.assert_close(out.loss, torch.tensor([[3.0, 2.0, -1.2]]))
    assert out.clipped.tolist() == [[True, False, True]]
    out.loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 2.0, 0.0]]))


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "sapo", "m2po"])
def test_huge_log_ratio_stays_finite(policy_loss):
    # log ratio 1000 would overflow exp in float32; clamped to 20 -> exp(20) = 4.85e8
    lp, old = _lp([1000.0, -1000.0, 0.5])
    adv = torch.tensor([[-1.0, 1.0, 1.0]])
    mask = torch.ones(1, 3)
    keep = torch.ones(1, 3, dtype=torch.bool)
    out = compute_policy_loss(LossConfig(policy_loss=policy_loss), lp, old, adv, mask, m2po_keep=keep)
    assert torch.isfinite(out.loss).all() and torch.isfinite(out.ratio).all()
    out.loss.sum().backward()
    assert torch.isfinite(lp.grad).all()


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "sapo", "m2po"])
def test_all_masked_gives_zero_loss_and_zero_grad(policy_loss):
    lp, old = _lp([0.3, float("nan")])
    adv = torch.tensor([[1.0, float("nan")]])
    mask = torch.zeros(1, 2)
    out = compute_policy_loss(
        LossConfig(policy_loss=policy_loss), lp, old, adv, mask, m2po_keep=torch.zeros(1, 2, dtype=torch.bool)
    )
    assert torch.all(out.loss == 0) and not out.clipped.any()
    out.loss.sum().backward()
    assert torch.all(lp.grad == 0)


def test_gspo_sequence_ratio_and_gradient_by_hand():
    # row 0: log ratios [0.2, 0.0] -> mean 0.1, s = e^0.1 = 1.105171 > 1 + 4e-4, A=1
    #        loss = max(-1.105171, -1.0004) = -1.0004 on both tokens, clipped, grad 0
    # row 1: log ratios [1e-4, -1e-4] -> mean 0, s = 1, A=-0.5 -> loss 0.5 per token,
    #        grad per token = -A * s = 0.5 (the token form); row 2 empty -> 0
    old = torch.full((3, 3), -1.0)
    lp = (old + torch.tensor([[0.2, 0.0, 0.0], [1e-4, -1e-4, 0.0], [0.0, 0.0, 0.0]])).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 0]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-0.5, -0.5, 0.0], [2.0, 2.0, 2.0]])
    out = gspo_loss(lp, old, adv, mask, clip_eps_low=3e-4, clip_eps_high=4e-4)
    torch.testing.assert_close(out.loss, torch.tensor([[-1.0004, -1.0004, 0], [0.5, 0.5, 0], [0, 0, 0]]))
    assert out.clipped.tolist() == [[True, True, False], [False, False, False], [False, False, False]]
    torch.testing.assert_close(out.ratio[0, :2], torch.full((2,), math.exp(0.1)))
    out.loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0, 0, 0], [0.5, 0.5, 0], [0, 0, 0]]), atol=1e-4, rtol=0)


def test_gspo_token_form_matches_sequence_objective_gradient():
    # sequence-level loss -A * exp(mean_t log r_t): d/d lp_t = -A * s / |o|.
    # With s = exp((0.01 - 0.02 + 0.03)/3) = exp(0.0066667) (inside the clip when eps=0.1)
    old = torch.zeros(1, 3)
    lp = torch.tensor([[0.01, -0.02, 0.03]], requires_grad=True)
    out = gspo_loss(lp, old, torch.full((1, 3), 2.0), torch.ones(1, 3), clip_eps_low=0.1, clip_eps_high=0.1)
    (out.loss.sum() / 3).backward()  # seq-mean-token-mean over one sequence
    s = math.exp(0.02 / 3)
    torch.testing.assert_close(lp.grad, torch.full((1, 3), -2.0 * s / 3))


def test_sapo_gate_by_hand():
    # gate = (4/tau) sigmoid(tau (r - 1)); loss = -gate A
    # t0 r=1, A=1, tau=1:     gate = 4 * 0.5 = 2 -> loss -2; grad = -A * 4 * sigmoid'(0) * r = -1
    # t1 r=1, A=-1, tau=1.05: gate = (4/1.05) * 0.5 = 1.904762 -> loss 1.904762; grad = +1
    # t2 r=e, A=1, tau=1: sigmoid(1.718282) = 0.847907, gate 3.391630 -> loss -3.391630
    lp, old = _lp([0.0, 0.0, 1.0])
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    out = sapo_loss(lp, old, adv, torch.ones(1, 3), tau_pos=1.0, tau_neg=1.05)
    torch.testing.assert_close(out.loss, torch.tensor([[-2.0, 1.904762, -3.391630]]))
    assert not out.clipped.any()
    out.loss[0, :2].sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 1.0, 0.0]]))


def test_m2po_mask_by_hand():
    # valid log ratios [0.5, 0.1, -0.1, 0.0], squares [0.25, 0.01, 0.01, 0]
    # M2 = 0.27/4 = 0.0675 > 0.04 -> drop 0.25 -> 0.02/3 = 0.00667 <= 0.04: keep the rest
    lr = torch.tensor([[0.5, 0.1, -0.1, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert m2po_keep_mask(lr, mask, 0.04).tolist() == [[False, True, True, True, False]]
    # 0.0675 <= 0.3: nothing dropped
    assert m2po_keep_mask(lr, mask, 0.3).tolist() == [[True, True, True, True, False]]
    # threshold 0: drop until the mean is 0 -> only the 0.0 token stays
    assert m2po_keep_mask(lr, mask, 0.0).tolist() == [[False, False, False, True, False]]
    assert not m2po_keep_mask(lr, torch.zeros(1, 5), 0.04).any()


def test_m2po_loss_by_hand():
    # loss = -M r A, no clip: t0 r=e^0.5 kept, A=1 -> -1.648721; t1 masked out -> 0
    lp, old = _lp([0.5, 3.0])
    keep = torch.tensor([[True, False]])
    out = m2po_loss(lp, old, torch.ones(1, 2), torch.ones(1, 2), keep_mask=keep)
    torch.testing.assert_close(out.loss, torch.tensor([[-math.exp(0.5), 0.0]]))
    assert out.clipped.tolist() == [[False, True]]


def test_behavior_importance_weight_cap_modes_by_hand():
    # log(prox/behav) = [ln 2, ln 10, 0, (masked)] -> w = [2, 10, 1]; cap 5
    prox = torch.tensor([[math.log(2.0), math.log(10.0), 0.0, 50.0]])
    behav = torch.zeros(1, 4)
    mask = torch.tensor([[1, 1, 1, 0]])
    w, capped = behavior_importance_weight(prox, behav, mask, cap=5.0, mode="mask")
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.0, 1.0, 0.0]]))
    assert capped.tolist() == [[False, True, False, False]]
    w, _ = behavior_importance_weight(prox, behav, mask, cap=5.0, mode="truncate")
    torch.testing.assert_close(w, torch.tensor([[2.0, 5.0, 1.0, 0.0]]))
    w, capped = behavior_importance_weight(prox, behav, mask, cap=None)
    torch.testing.assert_close(w, torch.tensor([[2.0, 10.0, 1.0, 0.0]]))
    assert not capped.any()


def test_value_loss_clipping_by_hand():
    # eps 0.2; loss = 0.5 * max((v-R)^2, (old + clip(v-old, +-0.2) - R)^2)
    # t0 v=1, old=.5, R=2: unclipped 1; v_clip = .7 -> 1.69 -> 0.845, clipped
    # t1 v=0, old=.5, R=0: unclipped 0; v_clip = .3 -> .09 -> 0.045, clipped
    # t2 v=.55, old=.5, R=1: unclipped .2025, v_clip = .55 (same) -> 0.10125, not clipped
    v = torch.tensor([[1.0, 0.0, 0.55, 7.0]])
    old = torch.tensor([[0.5, 0.5, 0.5, float("nan")]])
    ret = torch.tensor([[2.0, 0.0, 1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, clipped = value_loss(v, old, ret, mask, clip_eps=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.845, 0.045, 0.10125, 0.0]]))
    assert clipped.tolist() == [[True, True, False, False]]
    loss, _ = value_loss(v, old, ret, mask, clip_eps=None)
    torch.testing.assert_close(loss, torch.tensor([[0.5, 0.0, 0.10125, 0.0]]))
    # inside the range the clip is inactive even where old + (v - old) rounds away from v in fp32:
    # v = 0.0044653844, old = -0.18275668 (|v - old| = 0.187 < 0.2), old + (v - old) = 0.0044653863
    v, old = torch.tensor([[0.004465384408831596]]), torch.tensor([[-0.1827566772699356]])
    assert (old + (v - old)).item() != v.item()  # the rounding this case is about
    _, clipped = value_loss(v, old, torch.zeros(1, 1), torch.ones(1, 1), clip_eps=0.2)
    assert clipped.tolist() == [[False]]


def test_kl_estimators_by_hand():
    # pi = 0.5, pi_ref = 0.25: log r = ln(0.25/0.5) = -0.693147
    # k1 = -log r = 0.693147; k2 = 0.5 * 0.480453 = 0.240227; k3 = (0.5 - 1) + 0.693147 = 0.193147
    lp = torch.tensor([[math.log(0.5), math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)]])  # second token: equal -> 0 for all
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([[0.693147, 0.0]]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([[0.240227, 0.0]]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([[0.193147, 0.0]]))
    # overflow guard: log r = 1000 clamped to 20: k3 = e^20 - 1 - 20 = 485165174.4
    huge = kl_penalty(torch.zeros(1, 1), torch.full((1, 1), 1000.0), "k3")
    assert torch.isfinite(huge).all()
    torch.testing.assert_close(huge, torch.tensor([[485165174.4]]))
    # masked positions are 0 even when NaN
    masked = kl_penalty(torch.tensor([[float("nan")]]), torch.zeros(1, 1), "k3", loss_mask=torch.zeros(1, 1))
    assert masked.item() == 0.0
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(lp, ref, "k4")


def test_token_entropy_by_hand():
    # logits [0, 0]: uniform over 2 -> ln 2 = 0.693147
    # logits [0, ln 3]: p = [0.25, 0.75]; H = 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762 = 0.562335
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    torch.testing.assert_close(token_entropy(logits), torch.tensor([[0.693147, 0.562335]]))


def test_loss_config_validation_names_the_field():
    with pytest.raises(ValueError, match="LossConfig.policy_loss='ppo2'"):
        LossConfig(policy_loss="ppo2")
    with pytest.raises(ValueError, match="dual_clip_c"):
        LossConfig(dual_clip_c=0.5)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        LossConfig(loss_agg_mode="mean")
