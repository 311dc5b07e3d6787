"""The RL trainer on several processes (``runtime.parallel_trainer``) equals the single-process one.

1. One GRPO step on a tiny policy with dp2 (FSDP2) and with tp2 (DTensor TP, tied embedding
   kept tied): the loss, the merged metrics, the gradients and the gathered weights after the
   AdamW step match ``BaseAlgorithm.update_parameters`` in one process.
2. The arithmetic GRPO graph runs end to end with its ``train_step`` on 2 processes (dp2, then
   tp2) and generation in a third: every sample trained exactly once, weight versions advance.
3. A strategy the RL trainer cannot run fails before any worker process starts.

Tolerances (the runs differ only in the order of fp32 additions: FSDP's reduce-scatter sums
two half-batch gradients, TP sums partial matmuls; fp32 unit roundoff is 6e-8):

- loss and per-token metrics: relative 1e-5 (sums of ~40 terms of size ~1: error ~40 x 6e-8).
- gradients: ``rtol 1e-4, atol 1e-7`` (|g| <= ~1e-1; observed worst difference ~1e-8 dp2, ~5e-8 tp2).
- weights after the first AdamW step: the update is ``lr * g / (|g| + eps)`` (bias-corrected
  m = g, v = g^2; Loshchilov & Hutter 2019, Alg. 2), whose slope in g is
  ``eps / (|g| + eps)^2``; so a gradient error of at most ``d`` moves a weight by at most
  ``lr * d * eps / (max(|g| - d, 0) + eps)^2`` (capped at ``2 lr``), plus rounding: 4 machine
  epsilons of ``|w| + lr`` (the few fp32 operations of the update, ~lr, and ``w - update``).
  That bound is checked element by element with ``d`` the observed gradient difference plus
  the gradient tolerance.

The published weights are not bit-identical to the single-process run's (so their xxh64
checksums differ): the reductions above round differently, by a few ulps.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from areal_flow.algorithms.advantages import compute_advantages
from areal_flow.algorithms.catalog import ALGORITHMS
from areal_flow.algorithms.lookup import build_algorithm
from areal_flow.config_load import load_config
from areal_flow.models.logprobs import token_logprobs
from areal_flow.models.tiny import build_model
from areal_flow.models.tokenizer import build_char_tokenizer
from compiler.strategy import ParallelStrategy, StrategyError
from runtime.model_source import load_pretrained
from runtime.parallel.launch import spawn_workers
from runtime.parallel.weight_sync import full_named_tensors
from runtime.parallel_trainer import RankTrainer
from runtime.executors.train import TrainSettings
from runs import records as trained_records

REPO = Path(__file__).resolve().parents[1]
LR, EPS = 1e-3, 1e-8  # EPS: torch.optim.AdamW's default, which the trainer uses
LOSS_RTOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-7
TINY_RUN = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false",
            "async.max_staleness=1", "cluster.n_gpus_per_node=3", "train.weight_decay=0.1"]


CASES = {  # case -> (algorithm, strategy, packed rows); Dr.GRPO normalises by the step's sequences x longest
    # response; the packed cases must match the padded single-process reference too
    "grpo-dp2": ("grpo", "d2", False), "grpo-tp2": ("grpo", "t2", False), "dr_grpo-dp2": ("dr_grpo", "d2", False),
    "grpo-dp2-packed": ("grpo", "d2", True), "grpo-tp2-packed": ("grpo", "t2", True),
}


def _spec(folder: Path, algorithm: str, packed: bool = False) -> TrainSettings:
    loss = dataclasses.asdict(ALGORITHMS[algorithm].loss_config({}))  # what the compiler writes into the plan
    return TrainSettings(model_folder=str(folder), algorithm=algorithm, loss=loss, lr=LR, weight_decay=0.01,
                         max_grad_norm=1.0, micro_batch_size=2, temperature=1.0, seed=0, pack_sequences=packed)


def _batch(folder: Path) -> dict[str, torch.Tensor]:
    """2 groups x 4 samples. Rows 0-3 (dp rank 0) have responses of 1-4 tokens, rows 4-7 of
    3-6, so the step's token count (GRPO's token-mean) and longest response (Dr.GRPO's length)
    differ from either half's. Behavior log-probs are the policy's own plus
    noise of 0.3 nats, so some importance ratios leave the clip range [0.8, 1.2]."""
    generator = torch.Generator().manual_seed(3)
    lengths = [(3, 1), (3, 2), (4, 3), (2, 4), (3, 3), (5, 6), (2, 5), (4, 4)]  # (prompt, response) tokens
    width = max(p + r for p, r in lengths)
    input_ids = torch.zeros(8, width, dtype=torch.int64)
    attention_mask = torch.zeros(8, width, dtype=torch.int64)
    loss_mask = torch.zeros(8, width)
    for row, (p, r) in enumerate(lengths):
        input_ids[row, : p + r] = torch.randint(4, 50, (p + r,), generator=generator)
        attention_mask[row, : p + r] = 1
        loss_mask[row, p : p + r] = 1
    model, _ = load_pretrained(folder)
    with torch.no_grad():
        own = token_logprobs(model, input_ids, attention_mask)
    behavior = (own + 0.3 * torch.randn(own.shape, generator=generator)) * loss_mask
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    advantages = compute_advantages("grpo", rewards=rewards, group_ids=group_ids, loss_mask=loss_mask).advantages
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "behavior_logprobs": behavior, "advantages": advantages, "rewards": rewards, "group_ids": group_ids}


def _one_step_on_ranks(rank: int, world_size: int, folder: Path, batch: dict) -> dict | None:
    """Worker: one RL step per case, each on a fresh model; rank 0 returns them."""
    out = {}
    for case, (algorithm, text, packed) in CASES.items():
        trainer = RankTrainer.build(_spec(folder, algorithm, packed), ParallelStrategy.parse(text))
        stats = trainer.step(batch)
        grads = dict(full_named_tensors(trainer.parallel.module, grads=True))
        out[case] = {"stats": stats, "grads": grads, "state": trainer.gather_weights()}
    return out if rank == 0 else None


def _one_step_single_process(folder: Path, batch: dict, algorithm: str) -> dict:
    torch.manual_seed(0)
    model, _ = load_pretrained(folder)
    model.train()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    spec = _spec(folder, algorithm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    algorithm = build_algorithm(spec.algorithm, model, optimizer, micro_batch_size=spec.micro_batch_size,
                                max_grad_norm=spec.max_grad_norm, temperature=spec.temperature)
    stats = algorithm.update_parameters(batch)
    grads = dict(full_named_tensors(model, grads=True))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"stats": stats, "grads": grads, "state": state, "initial": initial}


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("policy")
    tokenizer = build_char_tokenizer()
    build_model("tiny-s", len(tokenizer), seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    batch = _batch(folder)
    parallel = spawn_workers(_one_step_on_ranks, 2, (folder, batch), backend="gloo")[0]
    return parallel, {algorithm: _one_step_single_process(folder, batch, algorithm) for algorithm in ("grpo", "dr_grpo")}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_one_rl_step_matches_single_process(one_step, case):
    parallel, reference = one_step
    got, ref = parallel[case], reference[CASES[case][0]]
    assert ref["stats"]["clip_frac"] > 0  # the clipped branch of the PPO objective is exercised
    assert got["stats"]["n_tokens"] == ref["stats"]["n_tokens"] == 28  # 1+2+3+4 + 3+6+5+4 response tokens
    assert got["stats"]["n_seqs"] == 8
    for key in ("loss", "policy_loss", "grad_norm", "entropy", "importance_weight_mean", "kl_behavior_current",
                "clip_frac", "importance_weight_max"):
        assert got["stats"][key] == pytest.approx(ref["stats"][key], rel=LOSS_RTOL), key
    assert list(got["grads"]) == list(ref["grads"])  # tied lm_head.weight included, as in the state dict
    worst = {}
    for name, expected in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], expected, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   msg=lambda m: f"grad {name}: {m}")
        worst[name] = (got["grads"][name] - expected).abs() + GRAD_ATOL + GRAD_RTOL * expected.abs()
    # published weights: same names and order as the single-process state dict, within the Adam bound
    assert list(got["state"]) == list(ref["state"])
    for name, expected in ref["state"].items():
        g, d = ref["grads"][name].abs(), worst[name]
        bound = torch.clamp(LR * d * EPS / ((g - d).clamp(min=0) + EPS) ** 2, max=2 * LR)
        bound += 4 * torch.finfo(torch.float32).eps * (expected.abs() + LR)  # rounding of the update and of w - update
        excess = (got["state"][name] - expected).abs() - bound
        assert excess.max() <= 0, f"weight {name}: {excess.max():.3g} beyond the Adam error bound"
    # the step moved the weights: an element with |g| >> eps moves by about lr (times the clip factor)
    moved = max(float((ref["state"][n] - ref["initial"][n]).abs().max()) for n in ref["state"])
    assert moved > LR / 2


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
     r"a step of 3 sequences .* must divide by dp=2"),
    # the tiny policy ties its embedding and LM head: pipeline stages would split them
    (["compile.allocation=train:d1p2 + gen:d1"], r"pp=2 needs tie_word_embeddings=False"),
])
def test_strategy_the_rl_trainer_cannot_run_fails_before_any_process(tmp_path, warm_cache, monkeypatch, overrides,
                                                                     rule):
    from areal_flow.cli import default_config_path, load_flow
    from areal_flow.cli.run import run_experiment
    from runtime import launch

    def refuse(*args, **kwargs):
        raise AssertionError("worker processes were started")

    monkeypatch.setattr(launch.LocalScheduler, "start", refuse)
    flow = load_flow(REPO / "graphs/arith_grpo.py")
    cfg = load_config(default_config_path(flow, None), [*TINY_RUN, *overrides, f"out_dir={tmp_path}"])
    with pytest.raises(StrategyError, match=rule):
        run_experiment(flow(cfg), cfg, show_progress=False)
