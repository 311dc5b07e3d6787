"""The RL trainer on several processes (``runtime.parallel_trainer``) equals the single-process one.

1. One GRPO step on a tiny policy with dp2 (FSDP2) and with tp2 (DTensor TP, tied embedding
   kept tied): the loss, the merged metrics, the gradients and the gathered weights after the
   AdamW step match ``BaseAlgorithm.update_parameters`` in one process.
2. The arithmetic GRPO graph runs end to end with its ``train_step`` on 2 processes (dp2, then
   tp2) and generation in a third: every sample trained exactly once, weight versions advance.
3. A strategy the RL trainer cannot run fails before any worker process starts.

Tolerances and why: ``rl_step_cases``.

The published weights are not bit-identical to the single-process run's (so their xxh64
checksums differ): the reductions above round differently, by a few ulps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from areal_flow.config_load import load_config
from compiler.strategy import ParallelStrategy
from rl_step_cases import assert_step_matches, policy_folder, rl_batch, settings, single_process_step
from runtime.model_source import load_pretrained
from runtime.parallel.launch import spawn_workers
from runtime.parallel.weight_sync import full_named_tensors
from runtime.parallel_trainer import RankTrainer
from runs import records as trained_records

REPO = Path(__file__).resolve().parents[1]
TINY_RUN = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false",
            "async.max_staleness=1", "cluster.n_gpus_per_node=3", "train.weight_decay=0.1"]


CASES = {  # case -> (algorithm, strategy, packed rows[, settings changed]); Dr.GRPO normalises by the step's
    # sequences x longest response; the packed cases and activation checkpointing (the plan's, recomputing each
    # layer in backward) must match the padded single-process reference too
    "grpo-dp2": ("grpo", "d2", False), "grpo-tp2": ("grpo", "t2", False), "dr_grpo-dp2": ("dr_grpo", "d2", False),
    "grpo-dp2-packed": ("grpo", "d2", True), "grpo-tp2-packed": ("grpo", "t2", True),
    "grpo-dp2-ac": ("grpo", "d2", False, {"activation_checkpointing": True}),
}


def _one_step_on_ranks(rank: int, world_size: int, folder: Path, batch: dict) -> dict | None:
    """Worker: one RL step per case, each on a fresh model; rank 0 returns them."""
    out = {}
    for case, (algorithm, text, packed, *fields) in CASES.items():
        trainer = RankTrainer.build(settings(folder, algorithm, packed, **(fields[0] if fields else {})),
                                    ParallelStrategy.parse(text))
        stats = trainer.step(batch)
        grads = dict(full_named_tensors(trainer.parallel.module, grads=True))
        out[case] = {"stats": stats, "grads": grads, "state": trainer.gather_weights()}
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    torch.set_num_threads(1)
    folder = policy_folder(tmp_path_factory.mktemp("policy"))
    batch = rl_batch(folder)
    parallel = spawn_workers(_one_step_on_ranks, 2, (folder, batch), backend="gloo")[0]
    return parallel, {algorithm: single_process_step(folder, batch, algorithm) for algorithm in ("grpo", "dr_grpo")}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_one_rl_step_matches_single_process(one_step, case):
    parallel, reference = one_step
    got, ref = parallel[case], reference[CASES[case][0]]
    assert ref["stats"]["clip_frac"] > 0  # the clipped branch of the PPO objective is exercised
    assert_step_matches(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("allocation", ["train:d2 + gen:d1", "train:t2 + gen:d1"])
def test_arith_grpo_trains_on_two_processes_with_generation_in_a_third(tmp_path, warm_cache, allocation):
    from areal_flow.cli import default_config_path, load_flow
    from areal_flow.cli.run import run_experiment

    flow = load_flow(REPO / "graphs/arith_grpo.py")
    cfg = load_config(default_config_path(flow, None), [*TINY_RUN, f"out_dir={tmp_path}",
                                                         f"compile.allocation={allocation}"])
    summary = run_experiment(flow(cfg), cfg, show_progress=False)
    out = tmp_path / flow.name
    plan = json.loads((out / "plan.json").read_text())
    strategy = {n["name"]: n["strategy"] for n in plan["nodes"]}["train_step"]
    assert ParallelStrategy.parse(strategy) == ParallelStrategy.parse(allocation.split()[0].removeprefix("train:"))
    trainer = summary["workers"]["train_step/0"]
    assert (trainer["steps"], trainer["consumed"], trainer["world_size"]) == (3, 3 * 2 * 4, 2)
    records = trained_records(out)
    # every sample of the 3 steps x 2 groups x 4 samples trained exactly once, in its step's slot
    assert sorted((r["group_id"], r["sample_id"]) for r in records) == sorted(
        {(r["group_id"], r["sample_id"]) for r in records})
    assert len(records) == 3 * 2 * 4
    assert all(r["group_id"] // 2 == r["step"] for r in records)
    # k = 1: step 2's groups are admitted only once version 1 arrived, so versions advanced
    rollout = summary["workers"]["generate/0"]
    assert rollout["weight_updates"] >= 1 and rollout["final_version"] >= 1
    assert all(min(r["versions"]) >= 1 for r in records if r["step"] == 2)
    assert all(r["staleness"] <= 1 for r in records)
    # rank 0 saved the gathered weights: at least AdamW's decay (train.weight_decay=0.1) moved them
    model, _ = load_pretrained(out / "model")
    assert not torch.equal(model.state_dict()["model.norm.weight"],
                           load_pretrained(summary["initial_model"])[0].state_dict()["model.norm.weight"])


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "rule"), [
    # 1 group x 3 samples = 3 sequences per step cannot be split over dp=2
    (["train.batch_size=1", "gen.n_samples=3", "compile.allocation=train:d2 + gen:d1"],
     r"rule 'rows-divide-dp': a step of 3 sequences .* must divide by dp=2"),
    # pipeline stages exchange micro-batches of one shape: no token budget
    (["compile.allocation=train:d1p2 + gen:d1", "train.max_tokens_per_micro_batch=64"],
     r"rule 'token-budget-no-pp': .*max_tokens_per_micro_batch=64 with pp=2: pipeline stages exchange"),
])
def test_strategy_the_rl_trainer_cannot_run_fails_before_any_process(tmp_path, warm_cache, monkeypatch, overrides,
                                                                     rule):
    from areal_flow.cli import default_config_path, load_flow
    from areal_flow.cli.run import run_experiment
    from compiler import AllocationError
    from runtime import launch

    def refuse(*args, **kwargs):
        raise AssertionError("worker processes were started")

    monkeypatch.setattr(launch.LocalScheduler, "start", refuse)
    flow = load_flow(REPO / "graphs/arith_grpo.py")
    cfg = load_config(default_config_path(flow, None), [*TINY_RUN, *overrides, f"out_dir={tmp_path}"])
    with pytest.raises(AllocationError, match=rule):  # the user's allocation, refused at compile
        run_experiment(flow(cfg), cfg, show_progress=False)
