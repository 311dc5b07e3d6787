"""fp16 training's dynamic loss scaling (areal_flow.algorithms.loss_scale) in BaseAlgorithm's step,
and in a train_step's checkpoint."""

import copy
import io

import pytest
import torch

from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.config import LossConfig
from areal_flow.models.logprobs import token_logprobs
from runtime.nonfinite import nonfinite_stats
from test_algorithms import make_batch, tiny_model
from test_nonfinite import _advantages, _train_executor

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


class TinyCritic(torch.nn.Module):
    """A value model in ``critic_update``'s layout: ``[batch, seq]`` ids -> ``[batch, seq]`` values."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 1)

    def forward(self, input_ids, attention_mask):
        return self.head(self.embed(input_ids)).squeeze(-1)


def critic_step(target: float, dtype):
    """One critic step (SGD, lr 1) toward returns ``target`` from V_old = the values now (no
    clipping), under autocast in ``dtype``; returns (metrics, critic before, critic after, scaler)."""
    from areal_flow.algorithms.critic_update import critic_update
    from areal_flow.algorithms.loss_scale import LossScaler, fp16_autocast

    critic = TinyCritic()
    before = copy.deepcopy(critic)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        values = critic(ids, mask).float()
    batch = {"input_ids": ids, "attention_mask": mask.long(), "values": values,
             "returns": torch.full_like(values, target)}
    norm = dict(n_tokens=8, n_seqs=2, norm_length=4)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        scaler = LossScaler("cpu") if fp16_autocast("cpu") else None
        metrics = critic_update(critic, torch.optim.SGD(critic.parameters(), lr=1.0), batch, mask, norm,
                                LossConfig(), [slice(0, 2)], max_grad_norm=1e9, scaler=scaler)
    return metrics, before, critic, scaler


def test_an_fp16_critic_step_is_scaled_and_matches_fp32():
    reference, _, _, _ = critic_step(1.0, torch.float32)
    metrics, _, _, scaler = critic_step(1.0, torch.float16)
    assert metrics["critic_loss_scale"] == 2.0 ** 16 and metrics["critic_loss_scale_overflow"] == 0.0
    assert scaler.scale == 2.0 ** 16  # no overflow: the scale stays (doubling needs 2,000 clean steps)
    assert reference["critic_grad_norm"] > 0
    assert metrics["critic_grad_norm"] == pytest.approx(reference["critic_grad_norm"], rel=1e-2)  # fp16 products


def test_an_fp16_critic_overflow_skips_the_step_and_halves_the_scale():
    # returns 1e5 from values ~1: dLoss/dV = (V - R) / 8 tokens ~ -1.2e4 a token, times 2**16 past fp16's 65504
    metrics, before, after, scaler = critic_step(1e5, torch.float16)
    assert metrics["critic_loss_scale_overflow"] == 1.0 and scaler.scale == 2.0 ** 15
    assert all(torch.equal(a, b) for a, b in zip(before.parameters(), after.parameters()))
    assert nonfinite_stats(metrics) == {}  # the scale's signal, not a non-finite step
    _, before, after, scaler = critic_step(1e5, torch.float32)
    assert scaler is None and not all(torch.equal(a, b) for a, b in zip(before.parameters(), after.parameters()))


@pytest.mark.slow
def test_a_train_steps_checkpoint_keeps_its_loss_scale_and_a_new_executor_continues_it(tmp_path, warm_cache):
    from areal_flow.ops.interfaces import Checkpointed
    from areal_flow.values import Advantages

    executor, node = _train_executor(tmp_path, "model.dtype=float16")
    assert isinstance(executor, Checkpointed)  # so runtime.step_checkpoint saves and restores it
    assert executor.checkpoint_state() == {}  # no fp16 step yet: no scaler
    adv = _advantages(executor.model.config.vocab_size)
    huge = Advantages({**adv.batch, "advantages": adv.batch["advantages"] * 1e6}, adv.trajectories)
    over = executor.run({"advantages": huge}, {"step": 0, "publish": False})["stats"].metrics
    clean = executor.run({"advantages": adv}, {"step": 1, "publish": False})["stats"].metrics
    assert over["loss_scale_overflow"] == 1.0 and clean["loss_scale_overflow"] == 0.0
    # Micikevicius et al. 2018 sec. 3.3: start 2**16, an overflow halves it and resets the clean-step count;
    # one clean step since counts 1 toward the next doubling (at 2,000)
    state = executor.checkpoint_state()
    assert state["policy"]["scale"] == 2.0 ** 15 and state["policy"]["_growth_tracker"] == 1
    saved = io.BytesIO()
    torch.save(state, saved)  # as trainer_state.pt holds it
    saved.seek(0)
    restarted, _ = _train_executor(tmp_path / "again", "model.dtype=float16")
    restarted.load_checkpoint_state(torch.load(saved, weights_only=False))
    assert restarted.checkpoint_state() == state
    assert restarted.algorithm.loss_scaler.scale == 2.0 ** 15  # not the fresh 2**16
    with pytest.raises(ValueError, match=f"train_step '{node.name}': a checkpointed value_head loss scale"):
        restarted.load_checkpoint_state({"value_head": state["policy"]})
