"""``train.lr_warmup_steps``: the learning rate each optimizer step of a train_step runs at.

The formula (``areal_flow.algorithms.lr_schedule``): step t (0-based) runs at
``lr * min(1, (t + 1) / W)``. With lr = 1e-3 and W = 4, by hand: 2.5e-4, 5e-4, 7.5e-4, then
1e-3 from step 3 on. Checked where AdamW reads it (``param_groups[*]["lr"]`` when
``optimizer.step`` runs) on a one-process trainer (``TrainStepExecutor`` with its own
optimizer) and on both ranks of a dp2 trainer (rank 0's executor broadcasts each step's
command, rank 1 follows it, ``runtime.parallel_trainer._follow``); and in the weights: a
fresh AdamW's first update of a weight is ``lr * g / (|g| + eps)`` (bias-corrected m = g,
v = g^2; Loshchilov & Hutter 2019, Alg. 2), so with weight decay 0 the largest change of any
weight after step 0 is lr(0) = 2.5e-4 (to within eps / |g|).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from areal_flow.algorithms.lr_schedule import warmup_lr
from areal_flow.config import ConfigError
from areal_flow.config_load import load_config
from compiler.strategy import ParallelStrategy
from rl_step_cases import policy_folder, rl_batch, settings
from runtime.executors.train import TrainStepExecutor
from runtime.model_source import load_pretrained
from runtime.parallel.launch import spawn_workers
from runtime.parallel_trainer import RankTrainer, _follow
from runtime.rank_commands import broadcast_command

LR, WARMUP = 1e-3, 4
BY_HAND = [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]  # steps 0-5: 1e-3 x 1/4, 2/4, 3/4, 1, 1, 1


def test_the_formula_by_hand():
    assert [warmup_lr(LR, WARMUP, t) for t in range(6)] == pytest.approx(BY_HAND, rel=1e-12)
    assert [warmup_lr(LR, 0, t) for t in range(3)] == [LR] * 3  # 0 = off
    assert warmup_lr(LR, 1, 0) == LR
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        warmup_lr(LR, -1, 0)


def test_the_key_its_hf_alias_and_a_negative_value():
    assert load_config(None, ["train.lr_warmup_steps=5"]).train.lr_warmup_steps == 5
    assert load_config(None, ["training.warmup_steps=3"]).train.lr_warmup_steps == 3  # HF TrainingArguments
    with pytest.raises(ConfigError, match="train.lr_warmup_steps=-2"):
        load_config(None, ["train.lr_warmup_steps=-2"])


def _record_lr(optimizer: torch.optim.Optimizer) -> list[float]:
    """The lr of every param group each time ``optimizer.step`` runs (one value when they agree)."""
    seen, step = [], optimizer.step

    def recording(*args, **kwargs):
        lrs = {group["lr"] for group in optimizer.param_groups}
        assert len(lrs) == 1, lrs
        seen.append(lrs.pop())
        return step(*args, **kwargs)

    optimizer.step = recording
    return seen


def _executor(**fields) -> TrainStepExecutor:
    """A train_step executor on ``fields`` (its settings, model, optimizer, ranks) without a plan."""
    executor = object.__new__(TrainStepExecutor)
    executor.__dict__.update({"node": SimpleNamespace(name="train_step"), "critic": False, "rank_critic": None,
                              "ranks": None, "micro_batches": 1, "ctx": SimpleNamespace(dtype=torch.float32), **fields})
    return executor


def test_one_process_trainer_steps_at_the_warmup_lr(tmp_path):
    folder = policy_folder(tmp_path)
    batch = rl_batch(folder)
    spec = settings(folder, "grpo", lr=LR, lr_warmup_steps=WARMUP, weight_decay=0.0)
    model, _ = load_pretrained(folder)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    seen = _record_lr(optimizer)
    executor = _executor(settings=spec, model=model, optimizer=optimizer,
                         algorithm=spec.build_algorithm(model, optimizer))
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(6):
        executor._step(batch, 8, {"step": step, "publish": False})
        if step == 0:
            moved = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
            assert moved == pytest.approx(BY_HAND[0], rel=1e-3)
    assert seen == pytest.approx(BY_HAND, rel=1e-12)


def _ranks(rank: int, world_size: int, folder, batch) -> list[float]:
    """Worker: a dp2 trainer; rank 0 steps as the executor does (steps 0-5), rank 1 follows."""
    spec = settings(folder, "grpo", lr=LR, lr_warmup_steps=WARMUP, weight_decay=0.0)
    trainer = RankTrainer.build(spec, ParallelStrategy.parse("d2"))
    seen = _record_lr(trainer.algorithm.optimizer)
    if rank == 0:
        executor = _executor(settings=spec, ranks=trainer, algorithm=trainer.algorithm)
        for step in range(6):
            executor._step(batch, 8, {"step": step, "publish": False})
        broadcast_command(None)  # the end of the run: rank 1 leaves its loop
        trainer.gather_weights()  # what _follow's end joins
    else:
        _follow(trainer)
    return seen


@pytest.mark.slow
def test_every_rank_of_a_multi_rank_trainer_steps_at_the_warmup_lr(tmp_path):
    torch.set_num_threads(1)
    folder = policy_folder(tmp_path)
    seen = spawn_workers(_ranks, 2, (folder, rl_batch(folder)), backend="gloo")
    for rank, lrs in enumerate(seen):
        assert lrs == pytest.approx(BY_HAND, rel=1e-12), rank
