"""The trainer worker on several processes: a ``train_step`` whose plan strategy has world size > 1.

Owns how the ranks of one policy replica cooperate on an RL step; the parallelism itself
is ``runtime.parallel`` (mesh, FSDP2, DTensor TP, bucketed weight gather). The launcher
starts :func:`run_parallel_trainer` in place of ``trainer_worker.run_trainer_worker`` when
the plan's ``train_step`` strategy has ``world_size > 1``; it spawns ``world_size`` ranks
joined by a gloo process group and a ``[pp, dp, cp, tp]`` device mesh.

Protocol, every step:

1. Rank 0 alone holds the channels: it takes step ``s``'s groups from the experience
   channel in admission order (exactly as the single-process trainer), collates them and
   computes the advantages over the whole batch (group statistics need whole groups).
2. Rank 0 broadcasts the batch (``broadcast_object_list``) with a flag saying whether the
   weights are needed after the step; every rank keeps the rows of its DP coordinate
   (``B / dp`` contiguous rows; TP ranks of one DP coordinate keep the same rows).
3. The loss normalisers of the *whole* step (valid tokens and sequences summed, longest
   response maxed) are all-reduced over the ``dp_cp`` ranks and passed to
   ``BaseAlgorithm.update_parameters``, which runs on every rank: FSDP sums the ranks'
   gradients (divide factor 1), so the gradient is that of the global loss; TP ranks see
   the whole batch and compute one model between them.
4. When flagged, the full weights are gathered bucket by bucket (``iter_weight_buckets``,
   every rank joins each collective) and kept on rank 0, which publishes them as version
   ``s + 1`` on the weight channel, writes the trajectories JSONL and the step's metrics
   (summed / token-weighted over the DP ranks, :func:`merge_dp_metrics`).

A ``None`` command ends the loop: one last gather, rank 0 saves ``out_dir/model``.
Supported: ``dp`` and ``tp`` (and both); the critic (PPO) and ``pp``/``cp``/``ep`` are
refused by :func:`check_parallel_training` before any process starts.
"""

from __future__ import annotations

import ctypes
import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

from areal_flow.algorithms.aggregation import step_normalisers
from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.registry import build_algorithm
from compiler.strategy import ParallelStrategy, StrategyError
from runtime.batching import collate
from runtime.channels import ExperienceReceiver
from runtime.model_source import load_pretrained
from runtime.parallel.apply import ParallelModel, parallelize
from runtime.parallel.launch import spawn_workers
from runtime.parallel.mesh import build_device_mesh, dp_cp_mesh
from runtime.parallel.tensor_parallel import replicate_unsharded
from runtime.parallel.validate import validate_strategy_for_model
from runtime.parallel.weight_sync import iter_weight_buckets
from runtime.staleness import OrderedExperienceBuffer
from runtime.trainer_worker import (
    TrainerSpec, _add_advantages, _extra_models, _trajectory_record, receive_step, step_metrics,
)
from runtime.weights import DEFAULT_BUCKET_BYTES, WeightPublisher

_SUMMED = ("loss", "policy_loss", "n_tokens", "n_seqs")  # totals of the rank's share of the global loss
_MAXED = ("importance_weight_max", "step_skipped", "grad_norm")  # grad_norm: already global, equal on every rank


def check_parallel_training(strategy: ParallelStrategy, model_folder: str | Path, *, rows: int,
                            critic: bool) -> None:
    """Refuse, before any process starts, a strategy the RL trainer cannot run.

    Args:
        strategy: the plan's ``train_step`` strategy.
        model_folder: the version-0 policy (its ``config.json`` gives heads, layers, ties).
        rows: sequences per optimizer step (``train.batch_size * gen.n_samples``).
        critic: the graph trains a critic with the policy (PPO).

    Raises:
        StrategyError: naming the rule: those of ``validate_strategy_for_model``; only
            ``dp``/``tp`` are wired into the RL loss; ``rows`` divisible by ``dp``; no critic.
    """
    validate_strategy_for_model(strategy, AutoConfig.from_pretrained(model_folder))
    if strategy.pp > 1 or strategy.cp > 1 or strategy.ep > 1:
        raise StrategyError(f"train_step strategy {strategy.short()}: the RL trainer runs dp and tp only (pp, cp "
                            "and ep would need the policy loss inside a pipeline schedule or sequence chunks)")
    if rows % strategy.dp:
        raise StrategyError(f"train_step strategy {strategy.short()}: a step of {rows} sequences (train.batch_size "
                            f"x gen.n_samples) must divide by dp={strategy.dp}: every DP rank runs as many "
                            "micro-batches (FSDP collectives) as the others")
    if critic:
        raise StrategyError(f"train_step strategy {strategy.short()}: a critic trains in the policy's process; "
                            "run its graph with a world size of 1 (e.g. train:d1)")


def merge_dp_metrics(stats: dict[str, float], group: dist.ProcessGroup) -> dict[str, float]:
    """The step's metrics over the DP ranks (a collective of ``group``).

    Totals (``loss``, ``policy_loss``, ``n_tokens``, ``n_seqs``) add up (each rank's loss is
    its share of the globally normalised loss); ``*_max``, ``step_skipped`` and
    ``grad_norm`` (global already) take the maximum; every other metric is a per-token mean
    over the rank's valid tokens, so it is weighted by the rank's ``n_tokens``.
    """
    per_rank: list[dict[str, float]] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(per_rank, stats, group=group)
    weights = [r["n_tokens"] for r in per_rank]
    merged = {}
    for key in stats:
        values = [r[key] for r in per_rank]
        if key in _SUMMED:
            merged[key] = sum(values)
        elif key in _MAXED:
            merged[key] = max(values)
        else:
            merged[key] = sum(w * v for w, v in zip(weights, values)) / max(sum(weights), 1.0)
    return merged


@dataclass
class RankTrainer:
    """One rank's share of the policy: its parallelized module and the algorithm around it."""

    rank: int
    strategy: ParallelStrategy
    parallel: ParallelModel
    algorithm: BaseAlgorithm

    @classmethod
    def build(cls, spec: TrainerSpec, strategy: ParallelStrategy) -> "RankTrainer":
        """Load the policy, apply ``strategy`` (FSDP2 over ``dp``, DTensor TP over ``tp``) and
        build the algorithm on the sharded parameters. Every rank calls this (collectives).
        Rank 0 alone holds the frozen reference policy (its log-probs travel in the batch)."""
        rank = dist.get_rank()
        torch.manual_seed(spec.seed)
        model, _ = load_pretrained(spec.model_folder)
        mesh = build_device_mesh(strategy, "cpu")
        parallel = parallelize(model.train(), strategy, mesh)
        if strategy.tp_enabled and strategy.dp * strategy.cp == 1:  # FSDP would make them DTensors otherwise
            replicate_unsharded(parallel.module, mesh["tp"])
        optimizer = torch.optim.AdamW(parallel.module.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
        extra = _extra_models(spec) if rank == 0 else {}
        algorithm = build_algorithm(
            spec.algorithm, parallel.module, optimizer, loss_overrides=dict(spec.loss_overrides),
            micro_batch_size=spec.micro_batch_size, max_grad_norm=spec.max_grad_norm, temperature=spec.temperature,
            **extra,
        )
        return cls(rank, strategy, parallel, algorithm)

    def step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on this rank's rows of the step's ``batch`` (``[B, T]`` tensors,
        advantages included; the same on every rank). Returns the metrics merged over the DP
        ranks (the same on every rank).

        Raises:
            ValueError: ``B`` not divisible by ``dp``; those of ``update_parameters``.
        """
        rows, dp = batch["input_ids"].shape[0], self.strategy.dp
        if rows % dp:
            raise ValueError(f"a step of {rows} sequences does not divide by dp={dp}")
        share = rows // dp
        start = self.parallel.coordinate["dp"] * share
        local = {k: v[start:start + share] for k, v in batch.items()}
        group = dp_cp_mesh(self.parallel.mesh).get_group()
        n_tokens, n_seqs, longest = step_normalisers(local["loss_mask"])
        counts = torch.tensor([n_tokens, n_seqs], dtype=torch.int64)
        dist.all_reduce(counts, group=group)
        longest_t = torch.tensor([longest], dtype=torch.int64)
        dist.all_reduce(longest_t, op=dist.ReduceOp.MAX, group=group)
        stats = self.algorithm.update_parameters(local, n_tokens=int(counts[0]), n_seqs=int(counts[1]),
                                                 norm_length=max(int(longest_t), 1))
        return merge_dp_metrics(stats, group)

    def gather_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, torch.Tensor] | None:
        """The full parameters (state-dict names and order, tied names included) on rank 0,
        ``None`` on the others. Every rank must call it (one all-gather per parameter); a
        rank other than 0 holds at most one bucket of ``bucket_bytes`` bytes at a time."""
        state: dict[str, torch.Tensor] = {}
        for bucket in iter_weight_buckets(self.parallel.module, bucket_bytes):
            if self.rank == 0:
                state.update(bucket.tensors)
        return state if self.rank == 0 else None


def _broadcast(command: dict | None) -> dict | None:
    box = [command]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _die_with_parent() -> None:
    """Linux: SIGTERM this rank when the trainer process that spawned it dies (so a
    launcher terminating the trainer leaves no rank blocked in a collective)."""
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _save(state: dict[str, torch.Tensor], spec: TrainerSpec, folder: Path) -> None:
    model, tokenizer = load_pretrained(spec.model_folder)
    model.load_state_dict(state, strict=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _follow(trainer: RankTrainer) -> None:
    while (command := _broadcast(None)) is not None:
        trainer.step(command["batch"])
        if command["gather"]:
            trainer.gather_weights()
    trainer.gather_weights()


def _lead(trainer: RankTrainer, spec: TrainerSpec, metrics_queue) -> dict:
    """Rank 0: the channels, advantages, publication, JSONL, metrics and the saved model."""
    _, tokenizer = load_pretrained(spec.model_folder)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    algorithm, cfg = trainer.algorithm, trainer.algorithm.loss_cfg
    if cfg.kl_in_reward and cfg.kl_coef > 0 and algorithm.ref_model is None:
        raise ValueError(f"algorithm {spec.algorithm!r} folds train.loss.kl_coef={cfg.kl_coef} into "
                         "the reward: the advantage node needs ref=Model(..., trainable=False)")
    receiver = ExperienceReceiver(spec.experience_address)
    publisher = WeightPublisher(spec.weight_address)
    buffer = OrderedExperienceBuffer(spec.batch_groups, spec.max_staleness)
    out = Path(spec.out_dir)
    (out / "trajectories").mkdir(parents=True, exist_ok=True)
    try:
        with (out / "trajectories" / "trajectories.jsonl").open("w") as log:
            for step in range(spec.steps):
                wait_s = receive_step(receiver, buffer, step, spec.recv_timeout_s)
                started = time.perf_counter()
                trajectories = [t for group in buffer.take_batch(step) for t in group]
                batch = collate(trajectories, pad_id)
                kl_reward = _add_advantages(batch, algorithm, spec)
                if algorithm.ref_model is not None and cfg.kl_coef > 0 and not cfg.kl_in_reward:
                    batch["ref_logprobs"] = algorithm.ref_logprobs(batch["input_ids"], batch["attention_mask"])
                publish = step + 1 < spec.steps  # the generator has everything it needs after the last step
                checkpoint = {}
                if spec.checkpoint_every and (step + 1) % spec.checkpoint_every == 0:
                    checkpoint["checkpoint"] = str(out / "checkpoints" / f"version_{step + 1}")
                _broadcast({"batch": batch, "gather": publish or bool(checkpoint)})
                stats = trainer.step(batch)
                if kl_reward is not None:
                    stats["kl_ref_in_reward"] = kl_reward
                if publish or checkpoint:
                    state = trainer.gather_weights()
                    if publish:
                        publisher.publish(state, step + 1)
                train_s = time.perf_counter() - started
                for t in trajectories:
                    log.write(json.dumps(_trajectory_record(t, step)) + "\n")
                log.flush()
                if checkpoint:
                    _save(state, spec, Path(checkpoint["checkpoint"]))
                metrics_queue.put(step_metrics(step, stats, batch, trajectories, train_s, wait_s) | checkpoint)
        _broadcast(None)
        _save(trainer.gather_weights(), spec, out / "model")
    finally:
        receiver.close()
        publisher.close()
    return {"steps": spec.steps, "consumed": len(buffer.consumed_ids), "world_size": trainer.strategy.world_size}


def _rank_main(rank: int, world_size: int, spec: TrainerSpec, strategy: ParallelStrategy, metrics_queue) -> dict | None:
    _die_with_parent()
    trainer = RankTrainer.build(spec, strategy)
    if rank == 0:
        return _lead(trainer, spec, metrics_queue)
    _follow(trainer)
    return None


def run_parallel_trainer(spec: TrainerSpec, metrics_queue, strategy: ParallelStrategy) -> dict:
    """Train ``spec.steps`` steps on ``strategy.world_size`` processes (gloo, CPU); puts one
    metrics dict per step on ``metrics_queue``, like ``run_trainer_worker``.

    Collectives wait up to ``spec.recv_timeout_s + 120`` seconds: the other ranks wait in a
    broadcast while rank 0 waits for experience.

    Returns:
        rank 0's ``{"steps", "consumed", "world_size"}``.

    Raises:
        StrategyError: ``strategy`` breaks a rule (:func:`check_parallel_training` is the
            launcher's early check; this repeats the model rules before spawning).
        runtime.parallel.launch.WorkerError: a rank raised (its rank and traceback inside),
            e.g. rank 0's TimeoutError when no experience arrives.
    """
    validate_strategy_for_model(strategy, AutoConfig.from_pretrained(spec.model_folder))
    results = spawn_workers(_rank_main, strategy.world_size, (spec, strategy, metrics_queue), backend="gloo",
                            timeout_s=spec.recv_timeout_s + 120.0)
    return results[0]
