"""A ``train_step`` whose plan strategy has world size > 1: the ranks of one policy replica.

Owns how the ranks cooperate on an RL step; the parallelism itself is ``runtime.parallel``
(mesh, FSDP2, DTensor TP, bucketed weight gather). The worker of the trainer's group
(``runtime.workers``) calls :func:`run_ranks` when its train_step's strategy has
``world_size > 1``: it spawns ``world_size`` ranks joined by a gloo (CPU) or NCCL (CUDA)
process group and a ``[pp, dp, cp, tp]`` device mesh; rank 0 runs the worker's one loop
(the same code as a single-process trainer) with the train_step's executor
(``runtime.executors.train``) driving the others.

Protocol, every step:

1. Rank 0 alone holds the channels: it takes step ``s``'s groups from the experience
   channel in admission order, runs the step's batch nodes before the train_step
   (advantages over the whole batch: group statistics need whole groups).
2. Rank 0 broadcasts the batch (signed: ``runtime.rank_commands``) with a flag saying whether the
   weights are needed after the step; every rank keeps the rows of its DP coordinate
   (``B / dp`` contiguous rows; TP ranks of one DP coordinate keep the same rows).
3. The loss normalisers of the *whole* step (valid tokens and sequences summed, longest
   response maxed) are all-reduced over the ``dp`` ranks (the ``cp``, ``tp`` and ``pp``
   ranks of one DP rank hold the same rows) and passed to
   ``BaseAlgorithm.update_parameters``, which runs on every rank: FSDP sums the ranks'
   gradients (divide factor 1), so the gradient is that of the global loss; TP ranks see
   the whole batch and compute one model between them; the algorithm's forward and
   backward passes go through a runner of ``runtime.parallel`` (``rl_pipeline`` under pp,
   ``rl_context`` under cp: sequence chunks, a whole-row loss). Each rank's micro-batch
   size is its share of the batch over the plan's micro-batches per DP rank.
4. When flagged, the full weights are gathered bucket by bucket (``iter_weight_buckets``,
   every rank joins each collective) and kept on rank 0, which publishes them on the
   weight channel; metrics are summed / token-weighted over the DP ranks
   (:func:`merge_dp_metrics`).

A command without a batch asks every rank for the full weights (a restarted replica's
resync) or, with ``checkpoint`` set, to save the ranks' shards of model and optimizer state
with ``torch.distributed.checkpoint`` (:meth:`RankTrainer.save_state`) or to load a checkpoint
of any world size and strategy into them (:meth:`RankTrainer.load_state`, ``runtime.reshard``). A ``None`` command ends the loop: one last gather, rank 0
saves the model.
Supported: ``dp``, ``tp`` and ``pp`` (and their products), ``cp`` with ``dp`` and ``tp``, ``ep``
over the ``dp`` ranks (with or without ``tp``), for the policy; under ``pp`` rank 0 (the first stage) drives the step as above and
the metrics come from the last stage. A critic's train_step (PPO) on the trainer's mesh runs
under the policy's strategy (dp, tp, cp and their products; pp or ep with dp) on the same ranks
(``runtime.parallel_critic``): its commands carry
``critic`` set, its batch is split and normalised as above, and after each of its steps its full weights are
gathered into rank 0's whole copy (the one the advantage node reads). What it cannot run is
refused before any process starts by the compiler's one predicate, ``compiler.executable``
(which the compiler's search obeys too).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from transformers import AutoConfig

from areal_flow.algorithms.aggregation import step_normalisers
from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.lr_schedule import set_lr
from compiler.strategy import ParallelStrategy
from runtime.checkpoint import SHARDED_DIR, read_state
from runtime.model_source import load_pretrained
from runtime.parallel.apply import ParallelConfig, ParallelModel, parallelize
from runtime.parallel.launch import RankSpan, spawn_workers
from runtime.parallel import signed_objects
from runtime.parallel.mesh import build_device_mesh
from runtime.parallel.rl_context import ContextRunner
from runtime.parallel_critic import RankCritic
from runtime.parallel.rl_pipeline import PipelineRunner
from runtime.parallel.rl_runner import ShardedRunner
from runtime.parallel.tensor_parallel import replicate_unsharded
from runtime.parallel.validate import validate_strategy_for_model
from runtime.parallel.weight_sync import iter_weight_buckets
from runtime.reshard import FLAT, experts_as_dtensors, load_sharded, load_whole_into_ranks, rename_parameters
from runtime.executors.train import algorithm_scaler_slots, load_loss_scales
from runtime.executors.train_settings import TrainSettings, micro_batch_size
from runtime.rank_commands import broadcast_command
from runtime.weights import DEFAULT_BUCKET_BYTES

_SUMMED = ("loss", "policy_loss", "n_tokens", "n_seqs")  # totals of the rank's share of the global loss
_MAXED = ("importance_weight_max", "step_skipped", "grad_norm")  # grad_norm: already global, equal on every rank


def merge_dp_metrics(stats: dict[str, float], group: dist.ProcessGroup) -> dict[str, float]:
    """The step's metrics over the DP ranks (a collective of ``group``).

    Totals (``loss``, ``policy_loss``, ``n_tokens``, ``n_seqs``) add up (each rank's loss is
    its share of the globally normalised loss); ``*_max``, ``step_skipped`` and
    ``grad_norm`` (global already) take the maximum; every other metric is a per-token mean
    over the rank's valid tokens, so it is weighted by the rank's ``n_tokens``.
    """
    per_rank: list[dict[str, float]] = signed_objects.all_gather(stats, "dp_metrics", group=group)
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
    """One rank's share of the policy: its parallelized module and the algorithm around it,
    and its share of a critic trained on the same ranks (``None``: no critic here). A critic
    on a mesh of its own has ranks without a policy (``parallel`` and ``algorithm`` None)."""

    rank: int
    strategy: ParallelStrategy
    parallel: ParallelModel | None
    algorithm: BaseAlgorithm | None
    critic: RankCritic | None = None

    @classmethod
    def build(cls, spec: TrainSettings | None, strategy: ParallelStrategy, device_type: str = "cpu",
              critic: TrainSettings | None = None) -> "RankTrainer":
        """Load the policy, apply ``strategy`` (FSDP2 over ``dp``, DTensor TP over ``tp``, this
        rank's stage under ``pp``) and build the algorithm on the sharded parameters, its passes
        run by a runner of ``runtime.parallel`` (``rl_pipeline`` under ``pp``); with ``critic``
        (its train_step's settings) the critic split over the same ranks too (``RankCritic.build``:
        ``pp`` and ``ep`` with ``dp`` only). ``spec`` None: no policy, the critic alone (a critic
        on a mesh of its own). Every rank calls this (collectives). A reference policy's
        log-probs travel in the batch (``ref_logprobs``)."""
        rank = dist.get_rank()
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        mesh = build_device_mesh(strategy, device_type)
        if spec is None:
            return cls(rank, strategy, None, None, RankCritic.build(critic, mesh, strategy, device_type))
        torch.manual_seed(spec.seed)
        model, _ = load_pretrained(spec.model_folder)
        if device_type == "cuda":
            model = model.cuda()
        # the runner drives a pipeline stage itself; activation checkpointing as the plan says
        config = ParallelConfig(n_microbatches=None, activation_checkpointing=spec.activation_checkpointing)
        parallel = parallelize(model.train(), strategy, mesh, config)
        if strategy.tp_enabled and strategy.dp * strategy.cp == 1:  # FSDP would make them DTensors otherwise
            replicate_unsharded(parallel.module, mesh["tp"])
        optimizer = torch.optim.AdamW(parallel.module.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
        algorithm = spec.build_algorithm(parallel.module, optimizer)
        runner = PipelineRunner if strategy.pp_enabled else ContextRunner if strategy.cp_enabled else ShardedRunner
        algorithm.runner = runner(parallel)
        value = RankCritic.build(critic, mesh, strategy, device_type) if critic is not None else None
        return cls(rank, strategy, parallel, algorithm, value)

    def step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on this rank's rows of the step's ``batch`` (``[B, T]`` tensors,
        advantages included; the same on every rank). Returns the metrics merged over the DP
        ranks (the same on every rank; under ``pp`` the last stage's, where the loss runs).
        Under ``pp`` the micro-batches are made small enough that there are at least ``pp``.

        Raises:
            ValueError: ``B`` not divisible by ``dp``; those of ``update_parameters``.
        """
        rows, dp = batch["input_ids"].shape[0], self.strategy.dp
        if rows % dp:
            raise ValueError(f"a step of {rows} sequences does not divide by dp={dp}")
        share = rows // dp
        start = self.parallel.coordinate["dp"] * share
        local = {k: v[start:start + share] for k, v in batch.items()}
        group = self.parallel.mesh["dp"].get_group()  # cp, tp and pp ranks of one DP rank hold the same rows
        n_tokens, n_seqs, longest = step_normalisers(local["loss_mask"])
        counts = torch.tensor([n_tokens, n_seqs], dtype=torch.int64)
        dist.all_reduce(counts, group=group)
        longest_t = torch.tensor([longest], dtype=torch.int64)
        dist.all_reduce(longest_t, op=dist.ReduceOp.MAX, group=group)
        if self.strategy.pp_enabled:
            algorithm = self.algorithm
            algorithm.micro_batch_size = min(algorithm.micro_batch_size, math.ceil(share / self.strategy.pp))
        stats = self.algorithm.update_parameters(local, n_tokens=int(counts[0]), n_seqs=int(counts[1]),
                                                 norm_length=max(int(longest_t), 1))
        stats = merge_dp_metrics(stats, group)
        if self.strategy.pp_enabled:
            stats = self.algorithm.runner.broadcast_from_last_stage(stats)
        return stats

    def gather_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, torch.Tensor] | None:
        """The full parameters (state-dict names and order, tied names included) on rank 0,
        ``None`` on the others. Every rank must call it (one all-gather per parameter); a
        rank other than 0 holds at most one bucket of ``bucket_bytes`` bytes at a time. Under
        ``pp`` each stage gathers its own parameters and its first rank sends them to rank 0
        bucket by bucket (on the CPU), after rank 0's own stage."""
        state: dict[str, torch.Tensor] = {}
        coordinate = self.parallel.coordinate
        sends = coordinate["pp"] > 0 and coordinate["dp"] == coordinate["cp"] == coordinate["tp"] == 0
        for bucket in iter_weight_buckets(self.parallel.module, bucket_bytes):
            if self.rank == 0:
                state.update(bucket.tensors)
            elif sends:
                signed_objects.send({k: v.cpu() for k, v in bucket.tensors.items()}, 0, "weight_buckets")
        if sends:
            signed_objects.send(None, 0, "weight_buckets")
        if self.rank == 0:
            for stage in range(1, self.strategy.pp):
                source = int(self.parallel.mesh.mesh[stage, 0, 0, 0])
                while (received := signed_objects.recv(source, "weight_buckets")) is not None:
                    state.update(received)
        return state if self.rank == 0 else None

    def save_state(self, folder: str | Path) -> None:
        """Save this rank's shards of the model and AdamW state (moments, step counts) to
        ``folder`` with ``torch.distributed.checkpoint`` (``get_state_dict``, then ``dcp.save``:
        one ``__<rank>_0.distcp`` file per rank and a ``.metadata`` file from rank 0; PyTorch
        docs, "Distributed Checkpoint - torch.distributed.checkpoint"), the optimizer state
        flattened (``reshard.FLAT``: pipeline stages' parameter groups differ). Every rank must
        call it (collectives); ``folder`` must be on a file system every rank sees.
        """
        model_state, optim_state = get_state_dict(self.parallel.module, self.algorithm.optimizer, options=FLAT)
        experts_as_dtensors(self.parallel.module, self._experts(), model_state, optim_state)
        optim_state = rename_parameters(optim_state, self._checkpoint_names())
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder))

    def _experts(self) -> tuple[list, object] | None:
        """Under ep: this rank's expert parameters and the ep mesh (``reshard.experts_as_dtensors``)."""
        return (self.parallel.expert_params, self.parallel.ep_mesh) if self.parallel.ep_mesh is not None else None

    def _checkpoint_names(self) -> dict[str, str] | None:
        """The last pipeline stage's copy of a tied embedding goes by the tied parameter's first
        name in a checkpoint's optimizer state, as in one process (``reshard.rename_parameters``)."""
        module = self.parallel.module
        if self.strategy.pp_enabled and module.tied_embeddings and module.is_last:
            return {"lm_head.weight": "model.embed_tokens.weight"}
        return None

    def load_state(self, folder: str | Path, world_size: int, node: str) -> None:
        """Load checkpoint ``folder`` (``runtime.checkpoint``), written by train_step ``node`` on
        ``world_size`` ranks, into this rank's shards, whatever the strategy that wrote it
        (every rank calls it; ``runtime.reshard``): several ranks' ``trainer_dcp/`` is read slice
        by slice; one process's weights and AdamW ``state_dict`` (``trainer_state.pt``) are
        scattered. Bit for bit either way.

        Raises:
            FileNotFoundError / RuntimeError (from DCP): ``folder`` holds no DCP checkpoint, or
                one of other tensors (names the missing keys).
            KeyError: ``trainer_state.pt`` holds no optimizer state of ``node``.
        """
        names = self._checkpoint_names()
        if world_size > 1:
            load_sharded(self.parallel.module, self.algorithm.optimizer, Path(folder) / SHARDED_DIR, names,
                         self._experts())
        else:
            load_whole_into_ranks(self.parallel.module, self.algorithm.optimizer, folder,
                                  read_state(Path(folder))["optimizers"][node], names)


def _follow(trainer: RankTrainer) -> None:
    """A rank other than 0: step on every broadcast batch until the ``None`` command."""
    while (command := broadcast_command(None)) is not None:
        if command.get("critic"):
            _follow_critic(trainer.critic, command)
            continue
        batch = command["batch"]
        if batch is None:  # between steps: a checkpoint's sharded state, or the weights only (a resync)
            checkpoint = command.get("checkpoint")
            if checkpoint is None:
                trainer.gather_weights()
            elif checkpoint[0] == "save":
                trainer.save_state(checkpoint[1])
            elif checkpoint[0] == "scales":  # a checkpoint's fp16 loss scales, rank 0's (TrainStepExecutor)
                load_loss_scales(checkpoint[1], algorithm_scaler_slots(trainer.algorithm), checkpoint[2])
            else:
                trainer.load_state(*checkpoint[1:])
            continue
        trainer.algorithm.micro_batch_size = micro_batch_size(batch["input_ids"].shape[0], trainer.strategy.dp,
                                                              command["micro_batches"])
        set_lr(trainer.algorithm.optimizer, command["lr"])  # rank 0's of this step (lr_schedule)
        dtype = command.get("dtype", torch.float32)  # rank 0's autocast (model.dtype), on every rank
        device = next(trainer.parallel.module.parameters()).device.type
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            trainer.step(batch)
        if command["gather"]:
            trainer.gather_weights()
    if trainer.parallel is not None:  # the policy's final weights (a critic's own ranks have none)
        trainer.gather_weights()


def _follow_critic(critic: RankCritic, command: dict) -> None:
    """A rank other than 0: the critic's part of ``command`` (a step, then the gather of its
    weights into rank 0's copy; or a checkpoint's save or load of its shards)."""
    checkpoint = command.get("checkpoint")
    if checkpoint is not None:
        if checkpoint[0] == "save":
            critic.save_state(checkpoint[1])
            return
        if checkpoint[0] == "scales":  # a checkpoint's fp16 loss scale, rank 0's (TrainStepExecutor)
            load_loss_scales(checkpoint[1], {"critic": (critic, "scaler")}, checkpoint[2])
            return
        if checkpoint[0] == "load":  # shards of several ranks
            critic.load_state(checkpoint[1])
        else:  # ("whole", critic folder, node): one process's critic, its optimizer in the version's state
            critic.load_whole(checkpoint[1], read_state(Path(checkpoint[1]).parent)["optimizers"][checkpoint[2]])
        critic.gather_into(None)  # rank 0's whole copy gets the loaded weights
        return
    set_lr(critic.optimizer, command["lr"])  # rank 0's of this step (lr_schedule)
    dtype = command.get("dtype", torch.float32)
    device = next(critic.module.parameters()).device.type
    with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        critic.step(command["batch"], command["micro_batches"])
    critic.gather_into(None)


def _rank_main(rank: int, world_size: int, settings: TrainSettings, strategy: ParallelStrategy, device_type: str,
               lead, args, critic: TrainSettings | None) -> object:
    trainer = RankTrainer.build(settings, strategy, device_type, critic)
    if rank == 0:
        return lead(trainer, *args)
    _follow(trainer)
    return None


def run_ranks(settings: TrainSettings | None, strategy: ParallelStrategy, lead, args: tuple, timeout_s: float,
              device_type: str = "cpu", backend: str = "gloo", secret: bytes | None = None,
              critic: TrainSettings | None = None, span: RankSpan | None = None) -> object:
    """Spawn ``strategy.world_size`` ranks (or ``span``'s, this machine's share of ranks spread
    over machines); rank 0 calls ``lead(rank_trainer, *args)`` and its result is returned (None
    where rank 0 is not spawned here), the others follow its broadcasts (:func:`_follow`).

    Collectives wait up to ``timeout_s`` seconds (the other ranks wait in a broadcast while
    rank 0 waits for experience). ``device_type``/``backend``: the plan's (``cpu``/``gloo``
    or ``cuda``/``nccl``; a rank uses GPU ``local rank mod device_count``, its rank among the
    ranks spawned on its machine). ``secret``: the run's
    channel secret, the key of every object the ranks exchange (``spawn_workers``). ``critic``:
    the settings of a critic's train_step trained on the same ranks (``RankTrainer.build``);
    ``settings`` None: the ranks train that critic alone (a critic on a mesh of its own).

    Raises:
        StrategyError: ``strategy`` breaks a model rule (checked before spawning).
        runtime.parallel.launch.WorkerError: a rank raised (its rank and traceback inside).
    """
    validate_strategy_for_model(strategy, AutoConfig.from_pretrained((settings or critic).model_folder))
    results = spawn_workers(_rank_main, strategy.world_size, (settings, strategy, device_type, lead, args, critic),
                            backend=backend, timeout_s=timeout_s, secret=secret, span=span)
    return results[0] if span is None or span.first == 0 else None
