"""A critic's train_step on two data-parallel ranks (``runtime.parallel.rl_critic``) equals the
single-process critic step (``critic_update`` as ``runtime.executors.train`` runs it).

1. Two optimizer steps of the tiny critic with dp2 (FSDP2, 2 micro-batches per rank) and on one
   process (2 micro-batches of 4 rows) on the same batch: the value loss, clip fraction and
   gradient norm and the gradients of each step, and the weights after the first, agree within
   the fp32 tolerances of ``rl_step_cases`` (the runs differ in the order of additions only:
   FSDP's reduce-scatter sums two half-batch gradients; observed: value loss 2e-8 relative,
   gradients 3e-8 absolute, weights 5e-7 after AdamW's first step); the whole copy rank 0
   gathers (what the advantage node reads for GAE's values) is the ranks' weights bit for bit.
2. PPO on arithmetic (``graphs/arith_ppo.py``) runs end to end with its policy and critic
   train_steps on the same 2 ranks (``train:d2 | critic_step:d2``) and a checkpoint, saved and
   resumed: every sample trained once, the critic's value loss reported, its sharded state
   in the critic's checkpoint folder.
3. A critic under tp (or on its own multi-rank mesh) is refused before any process starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from areal_flow.algorithms.aggregation import step_normalisers
from areal_flow.algorithms.critic_update import critic_update
from areal_flow.config_load import load_config
from areal_flow.models.critic import ValueModel
from areal_flow.models.tiny import build_model
from areal_flow.models.tokenizer import build_char_tokenizer
from compiler.strategy import ParallelStrategy, StrategyError
from rl_step_cases import GRAD_ATOL, GRAD_RTOL, LOSS_RTOL, assert_update_matches, rl_batch, settings
from runtime.executors.train import micro_batch_size
from runtime.parallel.launch import spawn_workers
from runtime.parallel.mesh import build_device_mesh
from runtime.parallel.rl_critic import RankCritic
from runtime.parallel.weight_sync import full_named_tensors
from runtime.parallel_trainer import check_parallel_training
from runtime.topology import TopologyError, build_topology
from runs import records as trained_records

REPO = Path(__file__).resolve().parents[1]
MICRO_BATCHES = 2
STEPS = 2
STATS = ("value_loss", "value_clip_frac", "critic_grad_norm")


def critic_batch(folder: Path) -> dict[str, torch.Tensor]:
    """``rl_batch`` (responses of 1-6 tokens, split unevenly over the two halves) with ``values``
    = the critic's own values + 0.3 noise (so some new values leave V_old +- 0.2: the clipped
    branch) and ``returns`` = standard normal targets, both on the response tokens."""
    batch = rl_batch(folder)
    generator = torch.Generator().manual_seed(5)
    mask = batch["loss_mask"]
    with torch.no_grad():
        own = ValueModel.from_policy(folder, seed=0)(input_ids=batch["input_ids"],
                                                      attention_mask=batch["attention_mask"])
    batch["values"] = (own + 0.3 * torch.randn(own.shape, generator=generator)) * mask
    batch["returns"] = torch.randn(own.shape, generator=generator) * mask
    return batch


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def single_process_critic(folder: Path, batch: dict) -> list[dict]:
    """The reference: the single-process critic step (``TrainStepExecutor._critic_step``) ``STEPS``
    times; per step its stats, gradients, weights before and after."""
    spec = settings(folder, "ppo")
    model = ValueModel.from_policy(folder, seed=spec.seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    mask = batch["loss_mask"].bool()
    n_tokens, n_seqs, longest = step_normalisers(mask)
    norm = dict(n_tokens=n_tokens, n_seqs=n_seqs, norm_length=max(longest, 1))
    rows = mask.shape[0]
    size = micro_batch_size(rows, 1, MICRO_BATCHES)
    slices = [slice(i, min(i + size, rows)) for i in range(0, rows, size)]
    out = []
    for _ in range(STEPS):
        initial = _state(model)
        stats = critic_update(model, optimizer, batch, mask, norm, spec.loss_config(), slices, spec.max_grad_norm)
        out.append({"stats": stats, "grads": dict(full_named_tensors(model, grads=True)), "state": _state(model),
                    "initial": initial})
    return out


def _critic_on_ranks(rank: int, world_size: int, folder: Path, batch: dict) -> list[dict] | None:
    """Worker: ``STEPS`` steps of ``RankCritic`` on dp2; rank 0 returns stats, full gradients,
    gathered weights and its whole copy after each."""
    spec = settings(folder, "ppo")
    mesh = build_device_mesh(ParallelStrategy.parse(f"d{world_size}"), "cpu")
    critic = RankCritic.build(spec, mesh["dp"])
    whole = ValueModel.from_policy(folder, seed=spec.seed) if rank == 0 else None
    out = []
    for _ in range(STEPS):
        stats = critic.step(batch, MICRO_BATCHES)
        grads = dict(full_named_tensors(critic.module, grads=True))
        state = dict(full_named_tensors(critic.module))
        critic.gather_into(whole)
        out.append({"stats": stats, "grads": grads, "state": state,
                    "whole": _state(whole) if whole is not None else None})
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def critic_steps(tmp_path_factory):
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("policy")
    tokenizer = build_char_tokenizer()
    build_model("tiny-s", len(tokenizer), seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    batch = critic_batch(folder)
    parallel = spawn_workers(_critic_on_ranks, 2, (folder, batch), backend="gloo")[0]
    return parallel, single_process_critic(folder, batch)


def test_critic_dp2_matches_single_process(critic_steps):
    parallel, reference = critic_steps
    first, ref = parallel[0], reference[0]
    assert 0 < ref["stats"]["value_clip_frac"] < 1  # both branches of the clipped value loss run
    for step, (got, expected) in enumerate(zip(parallel, reference)):
        for key in STATS:
            assert got["stats"][key] == pytest.approx(expected["stats"][key], rel=LOSS_RTOL), (step, key)
    assert_update_matches(first, ref)  # gradients, then the weights within the Adam error bound
    # the second step starts from weights within that bound (observed <= 6e-7): its gradients
    # still within the gradient tolerances (observed <= 3e-8)
    for name, expected in reference[1]["grads"].items():
        torch.testing.assert_close(parallel[1]["grads"][name], expected, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    for got in parallel:  # rank 0's whole copy (GAE's values, the saved critic) is the ranks' weights
        assert got["whole"].keys() == got["state"].keys()
        assert all(torch.equal(got["whole"][k], got["state"][k]) for k in got["state"])


def test_critic_strategy_other_than_dp_is_refused(tmp_path):
    tokenizer = build_char_tokenizer()
    build_model("tiny-s", len(tokenizer), seed=0).save_pretrained(tmp_path)
    with pytest.raises(StrategyError, match=r"d1t2: a critic's train_step runs data parallel only"):
        check_parallel_training(ParallelStrategy.parse("t2"), tmp_path, rows=8, critic=True)
    check_parallel_training(ParallelStrategy.parse("d2"), tmp_path, rows=8, critic=True)  # dp runs


def test_critic_on_its_own_multi_rank_mesh_is_refused():
    from areal_flow.cli import load_flow
    from compiler.program import compile_program

    fl = load_flow(REPO / "graphs/arith_ppo.py")
    cfg = load_config(REPO / "graphs/arith_ppo.yaml",
                      ["train.batch_size=2", "gen.n_samples=4", "cluster.n_gpus_per_node=8",
                       "compile.allocation=critic_step:d2 + train:d2 + gen:d1"])
    with pytest.raises(TopologyError, match="critic_step.*runs on the ranks of the policy's train_step"):
        build_topology(compile_program(fl(cfg), cfg))
    cfg = load_config(REPO / "graphs/arith_ppo.yaml",
                      ["train.batch_size=2", "gen.n_samples=4", "cluster.n_gpus_per_node=4",
                       "compile.allocation=train:d2 | critic_step:d2 + gen:d1"])
    groups = build_topology(compile_program(fl(cfg), cfg)).groups
    assert set(groups["train_step"].nodes) >= {"train_step", "critic_step"}


@pytest.mark.slow
def test_arith_ppo_trains_policy_and_critic_on_two_ranks(tmp_path, warm_cache):
    from areal_flow.cli import load_flow
    from areal_flow.cli.run import run_experiment

    flow = load_flow(REPO / "graphs/arith_ppo.py")
    run = ["train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false",
           "async.max_staleness=1", "cluster.n_gpus_per_node=4", "train.checkpoint_every=2",
           "compile.allocation=train:d2 | critic_step:d2 + gen:d1", f"out_dir={tmp_path}"]
    summary = run_experiment(flow(load_config(REPO / "graphs/arith_ppo.yaml", ["train.steps=2", *run])),
                             load_config(REPO / "graphs/arith_ppo.yaml", ["train.steps=2", *run]),
                             show_progress=False)
    out = tmp_path / flow.name
    plan = {n["name"]: n["strategy"] for n in json.loads((out / "plan.json").read_text())["nodes"]}
    assert plan["train_step"] == plan["critic_step"] == "d2"
    trainer = summary["workers"]["train_step/0"]
    assert (trainer["steps"], trainer["consumed"], trainer["world_size"]) == (2, 2 * 2 * 4, 2)
    assert len(trained_records(out)) == 2 * 2 * 4
    checkpoint = out / "checkpoints" / "version_2"
    assert (checkpoint / "critic" / "trainer_dcp" / ".metadata").is_file()  # the critic's shards, its own folder
    assert (checkpoint / "trainer_dcp" / ".metadata").is_file()  # the policy's
    assert ValueModel.load(out.parent / "critic").value_head.weight.shape == (1, ValueModel.load(
        out.parent / "critic").value_head.in_features)
