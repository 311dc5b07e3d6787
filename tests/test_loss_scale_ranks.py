"""fp16 dynamic loss scaling on the ranks of a multi-rank train_step (``areal_flow.algorithms.loss_scale``
in ``runtime.parallel_trainer`` and ``runtime.parallel_critic``).

1. Policy and critic on dp2 and on pp2: an inf placed in rank 1's gradients only (an overflow
   confined to one FSDP shard, or to the last pipeline stage's layers) is seen by both ranks: both
   skip the step and halve the scale, 2**16 -> 2**15 (Micikevicius et al. 2018, sec. 3.3: an
   overflowing step is skipped and the scale halved); the next, clean step runs at 2**15 on both
   and counts one clean step. Under pp the first stage never computes the loss, yet unscales its
   gradients (before, ``GradScaler.unscale_`` refused there: "_scale is None"), and without the
   all-reduced flag it would keep 2**16 and run its next step at another scale than the last
   stage's. (FSDP2's DTensor gradients already agree under a plain ``GradScaler``.)
2. A checkpoint's scales reach every rank: rank 0's train_step executor loads them
   (``load_checkpoint_state``) and the other rank, following its commands, makes the same.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from areal_flow.algorithms.loss_scale import LossScaler
from compiler.strategy import ParallelStrategy
from rl_step_cases import policy_folder, rl_batch, settings
from runtime.executors.train import TrainStepExecutor
from runtime.parallel.launch import spawn_workers
from runtime.parallel.mesh import build_device_mesh
from runtime.parallel_critic import RankCritic
from runtime.parallel_trainer import RankTrainer, _follow
from runtime.rank_commands import broadcast_command
from test_parallel_critic import critic_batch

START = 2.0 ** 16  # torch.amp.GradScaler's initial scale (torch.amp docs, "Gradient Scaling")
STRATEGIES = ("d2", "p2")  # FSDP2 shards (DTensor gradients); pipeline stages (each its own layers)
SAVED = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
         "_growth_tracker": 7}  # a checkpointed scale, chosen by hand


def _poison_rank_1(scaler: LossScaler) -> None:
    """Before ``scaler`` unscales the first time, put an inf into rank 1's local shard of the first gradient."""
    unscale, calls = scaler.unscale, []

    def poisoned(optimizer: torch.optim.Optimizer) -> None:
        calls.append(1)
        if dist.get_rank() == 1 and len(calls) == 1:
            grad = next(p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            with torch.no_grad():
                local.view(-1)[0] = float("inf")
        unscale(optimizer)

    scaler.unscale = poisoned


def _fp16(fn, *args):
    with torch.autocast("cpu", dtype=torch.float16):
        return fn(*args)


def _scale_state(scaler: LossScaler) -> tuple[float, int]:
    state = scaler.state_dict()
    return state["scale"], state["_growth_tracker"]


def _policy_steps(strategy: str, folder: Path, batch: dict) -> tuple:
    """Two fp16 steps of a policy on ``strategy``'s ranks, rank 1's first gradients poisoned:
    each step's stats and the scale (scale, clean steps) after each."""
    trainer = RankTrainer.build(settings(folder, "grpo"), ParallelStrategy.parse(strategy))
    trainer.algorithm.loss_scaler = LossScaler("cpu")
    _poison_rank_1(trainer.algorithm.loss_scaler)
    first = _fp16(trainer.step, batch)
    after_first = _scale_state(trainer.algorithm.loss_scaler)
    second = _fp16(trainer.step, batch)
    return first, after_first, second, _scale_state(trainer.algorithm.loss_scaler)


def _critic_steps(strategy: str, folder: Path, rows: dict) -> tuple:
    """As :func:`_policy_steps`, for a critic on ``strategy``'s ranks (2 micro-batches a rank)."""
    parsed = ParallelStrategy.parse(strategy)
    critic = RankCritic.build(settings(folder, "ppo"), build_device_mesh(parsed, "cpu"), parsed)
    critic.scaler = LossScaler("cpu")
    _poison_rank_1(critic.scaler)
    first = _fp16(critic.step, rows, 2)
    after_first = _scale_state(critic.scaler)
    second = _fp16(critic.step, rows, 2)
    return first, after_first, second, _scale_state(critic.scaler)


def _steps(rank: int, world_size: int, folder: Path, batch: dict, critic_rows: dict) -> dict:
    """Worker: the cases of the module doc; every rank returns what it saw."""
    out = {f"policy-{s}": _policy_steps(s, folder, batch) for s in STRATEGIES}
    out.update({f"critic-{s}": _critic_steps(s, folder, critic_rows) for s in STRATEGIES})
    # 2: rank 0 as the train_step's executor (TrainStepExecutor.load_checkpoint_state), rank 1 follows
    resumed = RankTrainer.build(settings(folder, "grpo"), ParallelStrategy.parse("d2"))
    if rank == 0:
        executor = object.__new__(TrainStepExecutor)
        executor.__dict__.update(node=SimpleNamespace(name="train_step"), critic=False, rank_critic=None,
                                 ranks=resumed, algorithm=resumed.algorithm, device="cpu")
        executor.load_checkpoint_state({"policy": SAVED})
        broadcast_command(None)  # the end of the run: rank 1 leaves its loop
        resumed.gather_weights()  # what _follow's end joins
    else:
        _follow(resumed)
    out["resumed"] = _scale_state(resumed.algorithm.loss_scaler)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    torch.set_num_threads(1)
    folder = policy_folder(tmp_path_factory.mktemp("policy"))
    return spawn_workers(_steps, 2, (folder, rl_batch(folder), critic_batch(folder)), backend="gloo")


@pytest.mark.slow
@pytest.mark.parametrize("case", [f"{role}-{s}" for role in ("policy", "critic") for s in STRATEGIES])
def test_an_overflow_on_one_rank_halves_the_scale_on_every_rank(ranks, case):
    prefix = "critic_" if case.startswith("critic") else ""
    for rank, seen in enumerate(ranks):
        first, after_first, second, after_second = seen[case]
        assert first[f"{prefix}loss_scale"] == START and first[f"{prefix}loss_scale_overflow"] == 1.0, rank
        assert after_first == (START / 2, 0), rank  # halved, the clean count reset
        assert second[f"{prefix}loss_scale"] == START / 2 and second[f"{prefix}loss_scale_overflow"] == 0.0, rank
        assert after_second == (START / 2, 1), rank
        if not prefix:
            assert (first["step_skipped"], second["step_skipped"]) == (1.0, 0.0), rank


@pytest.mark.slow
def test_a_checkpoints_scale_reaches_every_rank(ranks):
    assert [seen["resumed"] for seen in ranks] == [(SAVED["scale"], SAVED["_growth_tracker"])] * 2
