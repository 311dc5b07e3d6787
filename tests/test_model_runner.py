"""The one-process model runner computes the LM head only from the step's first scored column
(``areal_flow.algorithms.model_runner``, ``scored_from``) in both passes: the log-probs and entropy
the loss reads and the gradients, and the no-grad log-probs (M2PO's proximal policy, the reference
model's) on the scored positions, equal those of the whole row's logits."""

from __future__ import annotations

import copy

import torch

from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.config import LossConfig
from areal_flow.algorithms.micro_batches import plan_micro_batches
from areal_flow.algorithms.model_runner import ModelRunner
from test_algorithms import make_batch, tiny_model

torch.set_num_threads(1)


def _run(model, batch, scored_from: int) -> tuple[list, dict, list]:
    """One forward/backward of every micro-batch (2 rows each) with a loss of every masked
    log-prob and entropy; what the loss saw, the gradients and the LM head's widths."""
    seen = []
    mask = batch["loss_mask"].bool()

    def loss_fn(mb, logp, entropy):
        m = mb.take(mask)
        seen.append((mb.rows, logp.detach()[m], entropy.detach()[m]))
        return (logp * m).sum() + 0.1 * (entropy * m).sum()

    widths = []  # the positions the LM head ran on, per micro-batch
    model.lm_head.register_forward_hook(lambda module, args, out: widths.append(args[0].shape[1]))
    runner = ModelRunner(model)
    micro = plan_micro_batches(batch["attention_mask"], micro_batch_size=2)
    runner.forward_backward(micro, batch["input_ids"], batch["attention_mask"], loss_fn, temperature=0.7,
                            entropy_grad=True, scored_from=scored_from)
    return seen, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}, widths


def test_the_head_from_the_first_scored_column_gives_the_whole_rows_values_and_gradients():
    model = tiny_model().train()
    batch = make_batch(model)
    first = int(batch["loss_mask"].bool().any(dim=0).nonzero()[0])
    assert first > 1  # the prompts are longer than one token: columns 0..first-2 are skipped
    whole, whole_grads, whole_widths = _run(copy.deepcopy(model), batch, 0)
    part, part_grads, part_widths = _run(copy.deepcopy(model), batch, first)
    # the head ran on columns first - 1 .. w - 1 of each micro-batch of width w
    assert part_widths == [w - (first - 1) for w in whole_widths]
    for (rows_a, logp_a, ent_a), (rows_b, logp_b, ent_b) in zip(whole, part, strict=True):
        assert rows_a == rows_b
        torch.testing.assert_close(logp_b, logp_a, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ent_b, ent_a, rtol=1e-6, atol=1e-6)
    assert whole_grads.keys() == part_grads.keys()
    for name in whole_grads:  # fp32: the same sums, rows of the head's matmul taken fewer at a time
        torch.testing.assert_close(part_grads[name], whole_grads[name], rtol=1e-5, atol=1e-7)


def _head_widths(*models) -> list[int]:
    """The positions each LM head call of ``models`` runs on, in call order (filled as they run)."""
    widths = []
    for model in models:
        model.lm_head.register_forward_hook(lambda module, args, out: widths.append(args[0].shape[1]))
    return widths


def test_no_grad_logprobs_from_the_first_scored_column_equal_the_whole_rows_on_the_scored_positions():
    model = tiny_model()
    batch = make_batch(model)
    first = int(batch["loss_mask"].bool().any(dim=0).nonzero()[0])
    micro = plan_micro_batches(batch["attention_mask"], micro_batch_size=2)
    widths = _head_widths(model)
    runner = ModelRunner(model)
    whole = runner.logprobs(micro, batch["input_ids"], batch["attention_mask"], 0.7)
    whole_widths, widths[:] = list(widths), []
    part = runner.logprobs(micro, batch["input_ids"], batch["attention_mask"], 0.7, scored_from=first)
    assert widths == [w - (first - 1) for w in whole_widths]  # columns first - 1 .. w - 1
    scored = batch["attention_mask"].bool()
    scored[:, :first] = False  # every real token from the first scored column on
    assert bool((batch["loss_mask"].bool() <= scored).all())
    torch.testing.assert_close(part[scored], whole[scored], rtol=1e-6, atol=1e-6)
    assert not part[:, :first].any()  # the columns before hold 0


def test_an_m2po_step_with_a_reference_model_runs_every_lm_head_from_the_first_scored_column():
    model = tiny_model().train()
    batch = make_batch(model)
    first = int(batch["loss_mask"].bool().any(dim=0).nonzero()[0])
    ref = copy.deepcopy(model)
    widths = _head_widths(model, ref)
    algorithm = BaseAlgorithm(LossConfig(policy_loss="m2po", kl_coef=0.1), model,
                              torch.optim.SGD(model.parameters(), lr=1.0), micro_batch_size=2, max_grad_norm=1e6,
                              ref_model=ref)
    algorithm.update_parameters(batch)
    kept = [mb.width - (first - 1) for mb in plan_micro_batches(batch["attention_mask"], micro_batch_size=2)]
    assert widths == kept * 3  # the proximal log-probs, the reference's, the training pass


def test_the_reference_models_node_runs_the_head_from_the_groups_first_response_column():
    """``ops.logprobs`` (a frozen reference's log-probs): prompts of 3 and 5 tokens, responses of
    4 and 2, right-padded to 7 columns: the head runs on columns 2..6 (5 positions) and each
    response token's log-prob equals the whole row's (``token_logprobs`` on every column)."""
    from types import SimpleNamespace

    from areal_flow.models.logprobs import token_logprobs
    from areal_flow.ops.logprobs import LogprobsExecutor
    from areal_flow.types import Trajectory

    model = tiny_model().eval()
    group = [Trajectory("0:0", 0, [5, 6, 7], [8, 9, 10, 11], [0.0] * 4, [0] * 4, "stop"),
             Trajectory("0:1", 0, [5, 9, 6, 8, 7], [12, 13], [0.0] * 2, [0] * 2, "stop")]
    ctx = SimpleNamespace(model=lambda name: model, pad_id=0)
    node = SimpleNamespace(name="ref_logprobs", model="ref", attrs={"temperature": 0.7})
    widths = _head_widths(model)
    got = LogprobsExecutor(node, ctx).run({"rollouts": group}, {})["logprobs"]
    assert widths == [5]
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [5, 9, 6, 8, 7, 12, 13]])
    with torch.no_grad():
        whole = token_logprobs(model, ids, torch.ones_like(ids), temperature=0.7)
    assert len(got[0]) == 4 and len(got[1]) == 2
    torch.testing.assert_close(torch.tensor(got[0]), whole[0, 3:7], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got[1]), whole[1, 5:7], rtol=1e-6, atol=1e-6)
