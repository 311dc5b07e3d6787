"""fp16 training's dynamic loss scaling (areal_flow.algorithms.loss_scale) in BaseAlgorithm's step."""

import copy

import pytest
import torch

from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.config import LossConfig
from areal_flow.models.logprobs import token_logprobs
from runtime.nonfinite import nonfinite_stats
from test_algorithms import make_batch, tiny_model

torch.set_num_threads(1)


def step(model, batch, dtype):
    """One on-policy PPO step of a copy of ``model`` (SGD, lr 1) under autocast in ``dtype``;
    returns (metrics, updated model, algorithm)."""
    model = copy.deepcopy(model)
    algo = BaseAlgorithm(LossConfig(), model, torch.optim.SGD(model.parameters(), lr=1.0), micro_batch_size=5,
                         max_grad_norm=1e6)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        metrics = algo.update_parameters(batch)
    return metrics, model, algo


def scaled_batch(model, factor):
    batch = make_batch(model)
    batch["advantages"] = batch["advantages"] * factor
    return batch


def test_fp16_gradients_that_would_underflow_survive_scaling():
    # Advantages of 1e-8: the gradient reaching the logits is ~1e-9 per entry, below fp16's
    # smallest subnormal (2**-24 = 6e-8), so an unscaled fp16 backward flushes it to zero;
    # scaled by 2**16 it is ~6e-5, near fp16's smallest normal, and survives.
    model = tiny_model()
    batch = scaled_batch(model, 1e-8)
    unscaled = copy.deepcopy(model)  # the control: the same loss without scaling
    with torch.autocast("cpu", dtype=torch.float16):
        lp = token_logprobs(unscaled, batch["input_ids"], batch["attention_mask"])
        (-(lp * batch["advantages"]).sum()).backward()
    assert all(p.grad is None or not p.grad.any() for p in unscaled.parameters())
    reference, _, _ = step(model, batch, torch.float32)
    metrics, _, _ = step(model, batch, torch.float16)
    assert metrics["loss_scale"] == 2.0 ** 16 and metrics["loss_scale_overflow"] == 0.0
    assert metrics["step_skipped"] == 0.0
    assert reference["grad_norm"] > 0
    # fp16 products round to 11 bits: a few parts in 1e3 of the norm at most
    assert metrics["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-2)


def test_overflow_skips_the_step_and_halves_the_scale():
    # Advantages of 1e4: gradients ~1e4 times 2**16 exceed fp16's largest value (65504).
    model = tiny_model()
    batch = scaled_batch(model, 1e4)
    metrics, updated, algo = step(model, batch, torch.float16)
    assert metrics["loss_scale_overflow"] == 1.0 and metrics["step_skipped"] == 1.0
    assert metrics["loss_scale"] == 2.0 ** 16 and algo.loss_scaler.scale == 2.0 ** 15
    for before, after in zip(model.parameters(), updated.parameters()):
        assert torch.equal(before, after)
    assert nonfinite_stats(metrics) == {}  # not a non-finite step: the scale's signal to back off


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_scaling_outside_fp16(dtype):
    metrics, _, algo = step(tiny_model(), make_batch(tiny_model()), dtype)
    assert "loss_scale" not in metrics and algo.loss_scaler is None
