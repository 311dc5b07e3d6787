"""Loss aggregation modes with global normalisers, against hand arithmetic."""

import pytest
import torch

from areal_flow.algorithms.aggregation import aggregate_loss, step_normalisers
from areal_flow.algorithms.config import LOSS_AGG_MODES

# row 0: tokens [1, 2, 3] (last column padding, NaN); row 1: [4]; row 2: empty response
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, 0.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
# hand values, N_tok = 4, N_seq = 2 (the empty row does not count), L_const = 4
EXPECTED = {
    "token-mean": 2.5,  # (1+2+3+4) / 4
    "seq-mean-token-mean": 3.0,  # (6/3 + 4/1) / 2 = (2 + 4) / 2
    "seq-mean-token-sum": 5.0,  # (6 + 4) / 2
    "seq-mean-token-sum-norm": 1.25,  # 10 / (2 * 4)
}


def test_step_normalisers():
    # valid tokens 3 + 1 + 0 = 4; sequences with >= 1 token: 2; longest response: 3
    assert step_normalisers(MASK) == (4, 2, 3)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_modes_by_hand(mode):
    got = aggregate_loss(PER_TOKEN, MASK, mode, n_tokens=4, n_seqs=2, norm_length=4)
    assert got.item() == pytest.approx(EXPECTED[mode])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_whole_batch(mode):
    # split rows {0} and {1, 2}; with the global normalisers the parts add up exactly
    norm = dict(n_tokens=4, n_seqs=2, norm_length=4)
    a = aggregate_loss(PER_TOKEN[:1], MASK[:1], mode, **norm)
    b = aggregate_loss(PER_TOKEN[1:], MASK[1:], mode, **norm)
    assert (a + b).item() == pytest.approx(EXPECTED[mode])


def test_local_normaliser_would_be_wrong():
    # token-mean per micro-batch with *local* counts: 6/3 + 4/1 = 6, not 2.5 -> the mode
    # genuinely depends on the caller passing the step's global count
    local = aggregate_loss(PER_TOKEN[:1], MASK[:1], "token-mean", n_tokens=3, n_seqs=1) + aggregate_loss(
        PER_TOKEN[1:], MASK[1:], "token-mean", n_tokens=1, n_seqs=1
    )
    assert local.item() == pytest.approx(6.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_masked_is_zero_not_nan(mode):
    x = torch.full((2, 3), float("nan"), requires_grad=True)
    got = aggregate_loss(x, torch.zeros(2, 3), mode, n_tokens=0, n_seqs=0, norm_length=3)
    assert got.item() == 0.0
    got.backward()
    assert torch.all(x.grad == 0)


def test_gradient_weights_by_mode():
    # d loss / d L_t: token-mean 1/N_tok = 1/4; seq-mean-token-mean 1/(N_seq |o_i|) = 1/6 (row 0), 1/2 (row 1)
    x = torch.zeros(3, 4, requires_grad=True)
    aggregate_loss(x, MASK, "seq-mean-token-mean", n_tokens=4, n_seqs=2).backward()
    exp = torch.tensor([[1 / 6, 1 / 6, 1 / 6, 0], [0.5, 0, 0, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(x.grad, exp)
    x.grad = None
    aggregate_loss(x, MASK, "token-mean", n_tokens=4, n_seqs=2).backward()
    torch.testing.assert_close(x.grad, MASK.float() / 4)


def test_errors():
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        aggregate_loss(PER_TOKEN, MASK, "mean", n_tokens=4, n_seqs=2)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(PER_TOKEN, MASK, "seq-mean-token-sum-norm", n_tokens=4, n_seqs=2)
