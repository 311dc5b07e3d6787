"""The one-process model runner computes the LM head only from the step's first scored column
(``areal_flow.algorithms.model_runner``, ``scored_from``): the log-probs and entropy the loss reads
and the gradients equal those of the whole row's logits."""

from __future__ import annotations

import copy

import torch

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
