"""The one-process trainer's fused AdamW (``runtime.executors.train``): the update AdamW's
formula gives, checkpoints that do not carry the kernel choice, and a resume across the two
kernels that continues the same update (Loshchilov & Hutter 2019, Algorithm 2)."""

from __future__ import annotations

import torch

from runtime.executors.train import with_fused

LR, B1, B2, EPS = 0.1, 0.9, 0.999, 1e-8


def _model() -> torch.nn.Linear:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]]))
        model.bias.copy_(torch.tensor([0.25, -0.75]))
    return model


def _step(model: torch.nn.Linear, optimizer: torch.optim.Optimizer, grads: tuple[torch.Tensor, torch.Tensor]) -> None:
    model.weight.grad, model.bias.grad = grads[0].clone(), grads[1].clone()
    optimizer.step()


GRADS = [(torch.tensor([[0.5, -1.0, 2.0], [-0.25, 0.0, 1.0]]), torch.tensor([1.0, -0.5])),
         (torch.tensor([[-0.5, 1.0, 1.0], [0.75, 2.0, -1.0]]), torch.tensor([-1.0, 0.5]))]


def test_one_fused_step_is_adamws_first_step_by_hand():
    """Step 1 without weight decay: m_hat = g, v_hat = g^2, so p -= lr * g / (|g| + eps)."""
    model = _model()
    before = model.weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    _step(model, optimizer, GRADS[0])
    g = GRADS[0][0]
    expected = before - LR * g / (g.abs() + EPS)  # g = 0: no change
    assert torch.allclose(model.weight.detach(), expected, atol=1e-6)
    assert model.weight[1, 1].item() == 3.0


def test_a_checkpoint_carries_no_kernel_choice_and_the_input_is_left_alone():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    _step(model, optimizer, GRADS[0])
    state = optimizer.state_dict()
    written = with_fused(state, None)
    assert [g["fused"] for g in written["param_groups"]] == [None]
    assert state["param_groups"][0]["fused"] is True  # the optimizer's own dict is not changed
    assert written["state"] is state["state"]


def test_a_resume_across_kernels_continues_the_same_update():
    """An unfused run's checkpoint loaded into a fused optimizer (and back) stays on the
    loader's kernel and gives step 2 as the uninterrupted run does."""
    straight = _model()
    plain = torch.optim.AdamW(straight.parameters(), lr=LR, weight_decay=0.01)
    for grads in GRADS:
        _step(straight, plain, grads)
    for first, then in ((None, True), (True, None)):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=first)
        _step(model, optimizer, GRADS[0])
        checkpoint = with_fused(optimizer.state_dict(), None)
        resumed = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=then)
        resumed.load_state_dict(with_fused(checkpoint, then))
        assert resumed.param_groups[0]["fused"] is then
        _step(model, resumed, GRADS[1])
        assert torch.allclose(model.weight.detach(), straight.weight.detach(), atol=1e-6)
        assert torch.allclose(model.bias.detach(), straight.bias.detach(), atol=1e-6)
