"""The multi-rank runners compute the LM head only from the step's first scored column
(``scored_from``: ``rl_runner`` under dp / tp / ep, ``rl_pipeline``'s last stage, ``rl_context``'s
sequence chunks) in both passes: on 2 ranks (gloo, CPU) the log-probs and entropy the loss reads,
every rank's gradients and the no-grad log-probs (``runner.logprobs``) on the scored positions
equal those of the same runner on whole rows (``scored_from=0``), and the head runs on the
columns the formula gives.

Tolerances (as ``test_model_runner``: the two runs differ only in how many rows the head's
matmul takes at once, fp32): values rtol = atol = 1e-6, gradients rtol 1e-5, atol 1e-7.
"""

from __future__ import annotations

import pytest
import torch

from areal_flow.algorithms.micro_batches import plan_micro_batches
from compiler.strategy import ParallelStrategy
from rl_step_cases import policy_folder, settings
from runtime.parallel.launch import spawn_workers
from runtime.parallel.weight_sync import full_named_tensors
from runtime.parallel_trainer import RankTrainer

# strategy -> tiny preset: FSDP, TP, 1F1B pipeline (tied head on the last stage), Ulysses, MoE experts split
CASES = {"d2": "tiny-s", "t2": "tiny-s", "p2": "tiny-s", "c2": "tiny-s", "d2e2": "tiny-moe"}
# (prompt, response) tokens: the first response column is 9 in each DP half, so the head is
# skipped on columns 0..7; under cp2 rank 0's chunk (at most 7 columns) is all prompt
LENGTHS = [(9, 3), (10, 2), (11, 4), (9, 1), (12, 3), (9, 5), (10, 4), (11, 2)]
FIRST = 9


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    width = max(p + r for p, r in LENGTHS)
    out = {"input_ids": torch.zeros(len(LENGTHS), width, dtype=torch.int64),
           "attention_mask": torch.zeros(len(LENGTHS), width, dtype=torch.int64),
           "loss_mask": torch.zeros(len(LENGTHS), width)}
    for row, (p, r) in enumerate(LENGTHS):
        out["input_ids"][row, : p + r] = torch.randint(4, 50, (p + r,), generator=generator)
        out["attention_mask"][row, : p + r] = 1
        out["loss_mask"][row, p : p + r] = 1
    return out


def _pass(folder, text: str, batch: dict, scored_from: int) -> dict:
    """The no-grad log-probs of this rank's rows, then one forward/backward through the same runner
    with a loss of every masked log-prob and entropy: the log-probs ``[rows, T]`` and their scored
    positions (real tokens from column FIRST on), what the loss saw, this rank's full gradients,
    the head's widths in each pass."""
    trainer = RankTrainer.build(settings(folder, "grpo"), ParallelStrategy.parse(text))
    module, runner = trainer.parallel.module, trainer.algorithm.runner
    share = len(LENGTHS) // trainer.strategy.dp
    start = trainer.parallel.coordinate["dp"] * share
    local = {k: v[start : start + share] for k, v in batch.items()}
    mask = local["loss_mask"].bool()
    seen, widths = [], []

    def loss_fn(mb, logp, entropy):
        m = mb.take(mask)
        seen.append((mb.rows, logp.detach()[m], entropy.detach()[m]))
        return (logp * m).sum() + 0.1 * (entropy * m).sum()

    if getattr(module, "is_last", True):  # a middle or first pipeline stage holds no head
        module.lm_head.register_forward_hook(lambda mod, args, out: widths.append(args[0].shape[-2]))
    assert int(mask.any(dim=0).nonzero()[0]) == FIRST
    micro = plan_micro_batches(local["attention_mask"], micro_batch_size=2)
    logprobs = runner.logprobs(micro, local["input_ids"], local["attention_mask"], 0.7, scored_from)
    logprob_widths, widths[:] = list(widths), []
    runner.forward_backward(micro, local["input_ids"], local["attention_mask"], loss_fn, temperature=0.7,
                            entropy_grad=True, scored_from=scored_from)
    scored = local["attention_mask"].bool()
    scored[:, :FIRST] = False
    return {"seen": seen, "widths": widths, "grads": dict(full_named_tensors(module, grads=True)),
            "logprobs": logprobs, "scored": scored, "logprob_widths": logprob_widths,
            "cp_rank": trainer.parallel.coordinate["cp"]}


def _worker(rank: int, world_size: int, folders: dict, batch: dict) -> dict:
    torch.set_num_threads(1)
    return {text: (_pass(folders[text], text, batch, 0), _pass(folders[text], text, batch, FIRST))
            for text in CASES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folders = {text: policy_folder(tmp_path_factory.mktemp(text), preset) for text, preset in CASES.items()}
    return spawn_workers(_worker, 2, (folders, _batch()), backend="gloo")


def _expected_widths(text: str, whole_widths: list[int], cp_rank: int) -> list[int]:
    """The head's widths from the first scored column on, by hand, from its widths on whole rows:
    column FIRST - 1 on of each micro-batch of width w (the pipeline's stacked width: its step's
    columns), and under cp of each rank's chunk of c columns starting at cp_rank * c (at least the
    chunk's last one)."""
    if text == "c2":
        return [c - min(max(0, FIRST - 1 - cp_rank * c), c - 1) for c in whole_widths]
    return [w - (FIRST - 1) for w in whole_widths]


def _check_widths(text: str, whole: dict, part: dict, key: str, rank: int) -> None:
    """The head's widths of one pass (``key``) with the first scored column are the hand-computed
    ones, and fewer positions in all than on whole rows (where the head ran at all)."""
    assert part[key] == _expected_widths(text, whole[key], whole["cp_rank"]), rank
    assert sum(part[key]) < sum(whole[key]) or not whole[key]


@pytest.mark.slow
@pytest.mark.parametrize("text", list(CASES))
def test_head_from_the_first_scored_column_equals_whole_rows_on_two_ranks(runs, text):
    for rank, per_rank in enumerate(runs):
        whole, part = per_rank[text]
        _check_widths(text, whole, part, "widths", rank)
        assert len(whole["seen"]) == len(part["seen"])
        for (rows_a, logp_a, ent_a), (rows_b, logp_b, ent_b) in zip(whole["seen"], part["seen"], strict=True):
            assert rows_a == rows_b
            assert logp_a.numel() > 0
            torch.testing.assert_close(logp_b, logp_a, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(ent_b, ent_a, rtol=1e-6, atol=1e-6)
        assert whole["grads"].keys() == part["grads"].keys() and whole["grads"]
        for name, expected in whole["grads"].items():
            torch.testing.assert_close(part["grads"][name], expected, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{name}: {m}")
    if text == "p2":  # the loss and the head ran on the last stage only
        assert not runs[0][text][0]["seen"] and runs[1][text][0]["seen"]


@pytest.mark.slow
@pytest.mark.parametrize("text", list(CASES))
def test_no_grad_logprobs_from_the_first_scored_column_equal_whole_rows_on_two_ranks(runs, text):
    for rank, per_rank in enumerate(runs):
        whole, part = per_rank[text]
        _check_widths(text, whole, part, "logprob_widths", rank)
        scored = whole["scored"]
        torch.testing.assert_close(part["logprobs"][scored], whole["logprobs"][scored], rtol=1e-6, atol=1e-6)
        if text != "c2":  # the columns before hold 0 (under cp an all-prompt chunk's last position still runs)
            assert not part["logprobs"][:, :FIRST].any()
    holds_head = [1] if text == "p2" else [0, 1]  # the pipeline's log-probs are filled on its last stage only
    for rank, per_rank in enumerate(runs):
        logprobs, scored = per_rank[text][1]["logprobs"], per_rank[text][1]["scored"]
        assert bool(logprobs[scored].ne(0).all()) == (rank in holds_head), rank
