"""The trainer's executor: one optimizer step of its model per train step.

Owns how a node that trains its model (role ``training``: ``train_step``, or a user op
registered with this executor) becomes an update; it reads the step's batch from the node's
one data input port, whatever the op calls it (``runtime.topology.trainer_input``): the policy's algorithm
(``areal_flow.algorithms``) on one process, or on the ranks of a multi-rank strategy
(``runtime.parallel_trainer``: rank 0 runs this executor and drives the others), and the
critic's value update (``areal_flow.algorithms.critic_update``) when the node trains a
value model, on one process or on the policy's ranks (dp, tp, cp, pp, ep: ``runtime.parallel_critic``;
rank 0 then keeps a whole copy of the critic, gathered after every step). It follows the
plan: the micro-batches per DP rank (``NodePlan.micro_batches``), activation checkpointing
and the whole loss config the compiler merged (``attrs.loss``: ``compiler.algorithms``;
nothing here merges defaults), with the algorithm's class from the
registry or, for a user-registered one, from the plan (``plan.algorithms``). It must not
receive experience or publish weights: the worker does, with the ``weights`` this executor
returns.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

from areal_flow.algorithms.aggregation import step_normalisers
from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.critic_update import critic_update
from areal_flow.algorithms.dapo import overlong_filter
from areal_flow.algorithms.loss_scale import LossScaler, fp16_autocast
from areal_flow.algorithms.lr_schedule import set_lr
from areal_flow.dtypes import AUTO, BF16_CPU_FLAGS, MIN_BF16_SPEEDUP, cpu_has_bf16
from areal_flow.models.quiet import no_progress_bars
from areal_flow.values import Advantages, Stats, Weights
from runtime.engines.precision import autocast_bf16_speedup
from runtime.nonfinite import NonFiniteGuard
from runtime.rank_commands import broadcast_command
from runtime.executors.train_settings import TrainSettings, micro_batch_size
from runtime.topology import trainer_input
from runtime.train_phases import TrainPhaseSpans


FUSED_ADAMW = True
"""A one-process trainer's AdamW runs fused (``torch.optim.AdamW(fused=True)``: one kernel over
every tensor, the same update): tiny-arith's optimizer phase 4.6 -> 1.6 ms a step in the main
job at k = 0 (docs/PERFORMANCE.md, the TRL section). Multi-rank trainers keep the default."""


def with_fused(optimizer_state: dict, fused: bool | None) -> dict:
    """``optimizer_state`` (an AdamW ``state_dict``) with every param group's ``fused`` set to
    ``fused``: a checkpoint is written with ``None`` (the kernel is no part of the optimizer's
    state; a multi-rank trainer resuming it keeps its own) and loaded with this trainer's choice
    (``Optimizer.load_state_dict`` would otherwise take the checkpoint's flag, and place the
    step counts by it)."""
    groups = [{**group, "fused": fused} for group in optimizer_state["param_groups"]]
    return {**optimizer_state, "param_groups": groups}


class TrainStepExecutor:
    """Grain ``batch``: ``run({port: Advantages}, info) -> {"stats": Stats, "weights": Weights}``
    (``areal_flow.values``; an ``areal_flow.ops.interfaces.Trainer``); ``port`` is the node's one
    data input (``advantages`` for ``train_step``).

    ``info["publish"]``: the worker needs the full weights after this step (a weight route
    or a checkpoint); ``weights.state`` is then the state dict (gathered over ranks), else None.
    ``info["trace"]`` (optional, ``runtime.trace.TraceRecorder``): where the step's forward,
    backward and optimizer spans go (``runtime.train_phases``; one process only).
    """

    def __init__(self, node, ctx) -> None:
        self.node, self.ctx = node, ctx
        self.port = trainer_input(node)
        self.settings = TrainSettings.from_node(node, ctx)
        self.micro_batches = self.settings.micro_batches
        self.critic = ctx.plan.models[node.model]["head"] == "value"
        self.ranks = ctx.rank_trainer if not self.critic else None
        on_ranks = self.critic and ctx.rank_trainer is not None and node.parallel.world_size > 1
        self.rank_critic = ctx.rank_trainer.critic if on_ranks else None  # runtime.parallel_critic
        # a critic on ranks of its own (no policy there) ends the ranks' loop itself
        self.ends_ranks = on_ranks and ctx.rank_trainer.parallel is None
        self.device = "cuda" if ctx.plan.device_type == "cuda" else "cpu"  # the plan's device type
        self.phases = None  # runtime.train_phases, one process only
        self.critic_scaler: LossScaler | None = None  # a one-process critic's fp16 loss scale (first fp16 step)
        self.monitor = NonFiniteGuard.for_node(node, ctx)  # counts, keeps and stops on non-finite steps
        self._report_dtype(node)
        if self.ranks is not None:
            self.model = self.ranks.parallel.module
            self.algorithm = self.ranks.algorithm
            return
        self.model = ctx.model(node.model).to(self.device).train()
        if self.settings.activation_checkpointing:  # transformers >= 5.24 names it activation_checkpointing_enable
            enable = (getattr(self.model, "activation_checkpointing_enable", None)
                      or getattr(self.model, "gradient_checkpointing_enable", None))
            if enable is not None:
                enable()
        s = self.settings
        if self.rank_critic is not None:  # self.model: rank 0's whole copy; the optimizer: rank 0's shards
            self.optimizer = self.rank_critic.optimizer
            return
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=s.lr, weight_decay=s.weight_decay,
                                           fused=FUSED_ADAMW)
        if self.critic:
            self.loss_cfg = s.loss_config()
        else:
            self.algorithm = s.build_algorithm(self.model, self.optimizer)
        self.phases = TrainPhaseSpans(self.model, self.optimizer, node.name)
        if ctx.cores is not None:  # the threads a waiting generator lends, at each layer (runtime.core_lending)
            ctx.cores.follow(self.model, self.optimizer)

    def _report_dtype(self, node) -> None:
        """Say at start what ``model.dtype=auto`` chose on this device (stdout), or warn (stderr)
        where an explicit bfloat16 runs on a CPU without bf16 hardware."""
        configured = str(self.ctx.plan.run.get("dtype", "float32")).lower()
        chosen = str(self.ctx.dtype).removeprefix("torch.")
        has_bf16 = cpu_has_bf16() if self.device == "cpu" else None
        if configured == AUTO and self.ctx.rank == 0:
            print(f"{node.op} '{node.name}': model.dtype=auto chose {chosen} on {self.device} "
                  f"({self._dtype_reason(chosen, has_bf16)})", flush=True)
        elif chosen == "bfloat16" and has_bf16 is False:
            print(f"areal-flow: {node.op} '{node.name}': model.dtype=bfloat16 on a CPU without bf16 hardware "
                  f"({self._dtype_reason(chosen, has_bf16)}): its autocast step runs slower than float32 here; pass "
                  "model.dtype=auto or float32", file=sys.stderr, flush=True)

    def _dtype_reason(self, chosen: str, has_bf16: bool | None) -> str:
        """Why the device gives ``chosen``: the CPU flags, or (bf16 instructions, fp32 chosen) the
        timed bf16 product ``model.dtype=auto`` measured; only auto's choice is ever timed."""
        if has_bf16 is False:
            return f"none of {', '.join(BF16_CPU_FLAGS)} in /proc/cpuinfo"
        if chosen == "bfloat16":
            return "bf16 products in hardware"
        if has_bf16:
            return f"its bf16 products {autocast_bf16_speedup():.2f}x fp32's, {MIN_BF16_SPEEDUP}x needed"
        return "no CPU flags to read" if self.device == "cpu" else "compute capability below 8.0"

    def run(self, inputs: dict, info: dict) -> dict:
        adv: Advantages = inputs[self.port]
        batch, cut = adv.batch, None
        if self.settings.loss.get("mask_truncated"):  # DAPO overlong filtering: a cut response gets no loss
            cut = torch.tensor([t.finish_reason == "length" for t in adv.trajectories], dtype=torch.bool)
            batch = {**batch, "loss_mask": overlong_filter(batch["loss_mask"], cut)}
        if self.ranks is None and self.rank_critic is None and self.device != "cpu":
            batch = {k: v.to(self.device) for k, v in batch.items()}
        rows = batch["input_ids"].shape[0]
        dtype = self.ctx.dtype  # model.dtype: bf16/fp16 autocast over fp32 master weights and optimizer state
        phases = self.phases.active(info.get("trace"), step=info["step"]) if self.phases else contextlib.nullcontext()
        with phases, torch.autocast(self.device, dtype=dtype, enabled=dtype != torch.float32):
            stats = self._step(batch, rows, info)
        stats = {**stats, **adv.stats, **self.monitor.check(info["step"], stats, adv)}
        if cut is not None:  # the step's share of samples whose loss the filter dropped
            stats["overlong_filtered"] = float(cut.float().mean()) if cut.numel() else 0.0
        stats["critic_lr" if self.critic else "lr"] = self.settings.lr_at(info["step"])  # lr_schedule
        if not self.critic:  # what the plan's micro-batches came to on this step (sequences)
            stats["micro_batch_size"] = float(self.algorithm.micro_batch_size)
        return {"stats": Stats(stats), "weights": Weights(self.state_dict() if info["publish"] else None)}

    def _step(self, batch: dict, rows: int, info: dict) -> dict:
        lr = self.settings.lr_at(info["step"])  # the other ranks get it in the step's command
        set_lr(self.ranks.algorithm.optimizer if self.ranks is not None else self.optimizer, lr)
        if self.critic:
            stats = self._critic_step(batch, rows, lr)
        elif self.ranks is not None:
            broadcast_command({"batch": batch, "gather": info["publish"], "micro_batches": self.micro_batches,
                               "dtype": self.ctx.dtype, "lr": lr})
            self.algorithm.micro_batch_size = micro_batch_size(rows, self.ranks.strategy.dp, self.micro_batches)
            stats = self.ranks.step(batch)
        else:
            self.algorithm.micro_batch_size = micro_batch_size(rows, 1, self.micro_batches)
            stats = self.algorithm.update_parameters(batch)
        return stats

    def _critic_step(self, batch: dict, rows: int, lr: float) -> dict:
        if self.rank_critic is not None:  # every rank steps on its rows, then rank 0's copy gets the weights
            broadcast_command({"batch": batch, "critic": True, "micro_batches": self.micro_batches,
                               "dtype": self.ctx.dtype, "lr": lr})
            stats = self.rank_critic.step(batch, self.micro_batches)
            self.rank_critic.gather_into(self.model)
            return stats
        mask = batch["loss_mask"].bool()
        n_tokens, n_seqs, longest = step_normalisers(mask)
        norm = dict(n_tokens=n_tokens, n_seqs=n_seqs, norm_length=self.loss_cfg.loss_agg_norm_length or max(longest, 1))
        size = micro_batch_size(rows, 1, self.micro_batches)
        slices = [slice(i, min(i + size, rows)) for i in range(0, rows, size)]
        if self.critic_scaler is None and fp16_autocast(self.device):
            self.critic_scaler = LossScaler(self.device)
        return critic_update(self.model, self.optimizer, batch, mask, norm, self.loss_cfg, slices,
                             self.settings.max_grad_norm,
                             scaler=self.critic_scaler if fp16_autocast(self.device) else None)

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full weights (every rank joins the gather; rank 0 gets them)."""
        if self.ranks is not None:
            return self.ranks.gather_weights()
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def current_state(self) -> dict[str, torch.Tensor]:
        """The weights now, between steps (asks the other ranks to join the gather)."""
        if self.ranks is not None:
            broadcast_command({"batch": None, "gather": True, "micro_batches": self.micro_batches})
        return self.state_dict()

    def final_state(self) -> dict[str, torch.Tensor] | None:
        """The weights after the last step; on several ranks this also ends their loop."""
        if self.ranks is not None or self.ends_ranks:
            broadcast_command(None)
        return self.state_dict()

    def save(self, folder: Path, state: dict | None = None) -> None:
        """Write the model to ``folder`` (``transformers`` format; a critic adds its head)."""
        if self.critic:
            self.model.save(folder)
            return
        from runtime.model_source import load_pretrained

        model, tokenizer = load_pretrained(self.settings.model_folder)
        model.load_state_dict(state if state is not None else self.state_dict(), strict=True)
        with no_progress_bars():  # a checkpoint or the final model: no "Writing model shards" bar within the run's
            model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    def optimizer_state(self) -> dict | None:
        """The optimizer's ``state_dict`` (AdamW moments and step counts) for a checkpoint
        (``runtime.checkpoint``); None on several ranks (their state is sharded: :meth:`save_sharded`)."""
        return None if self.world_size > 1 else with_fused(self.optimizer.state_dict(), None)

    def _scaler_slots(self) -> dict[str, tuple[object, str]]:
        """Role -> (owner, attribute) of this train_step's fp16 loss scalers (made at the first fp16 step)."""
        if self.rank_critic is not None:
            return {"critic": (self.rank_critic, "scaler")}
        if self.critic:
            return {"critic": (self, "critic_scaler")}
        return algorithm_scaler_slots(self.algorithm)

    def checkpoint_state(self) -> dict:
        """What a checkpoint keeps of this train_step besides weights and optimizer
        (``areal_flow.ops.interfaces.Checkpointed``): its fp16 dynamic loss scales
        (``areal_flow.algorithms.loss_scale``) by role (``policy``, ``critic``); ``{}`` when it has
        none (not fp16). On several ranks rank 0's: the ranks share every overflow, so their
        scales are equal."""
        scalers = {role: getattr(owner, name) for role, (owner, name) in self._scaler_slots().items()}
        return {role: scaler.state_dict() for role, scaler in scalers.items() if scaler is not None}

    def load_checkpoint_state(self, state: dict) -> None:
        """Continue each role's loss scale from :meth:`checkpoint_state`'s ``state`` (a checkpoint
        of any number of ranks), on every rank of this train_step.

        Raises:
            ValueError: a role this train_step has no scaler for (naming the node)."""
        slots = self._scaler_slots()
        for role in state:
            if role not in slots:
                raise ValueError(f"train_step {self.node.name!r}: a checkpointed {role} loss scale, but it trains "
                                 f"{'a critic' if self.critic else 'a policy'} ({sorted(slots)})")
        if state and self.world_size > 1:  # the other ranks make theirs from the same state
            broadcast_command({"batch": None, "critic": self.rank_critic is not None,
                               "checkpoint": ("scales", state, self.device)})
        load_loss_scales(state, slots, self.device)

    @property
    def world_size(self) -> int:
        """Ranks this train_step runs on (1: this process alone)."""
        if self.rank_critic is not None:
            return self.rank_critic.strategy.world_size
        return self.ranks.strategy.world_size if self.ranks is not None else 1

    def save_sharded(self, folder: Path) -> None:
        """A multi-rank train_step: every rank saves its shards of model and optimizer state
        to ``folder`` (``torch.distributed.checkpoint``; ``RankTrainer.save_state``,
        ``RankCritic.save_state``).

        Raises:
            RuntimeError: a single-rank train_step (its state is whole: :meth:`optimizer_state`).
        """
        if self.rank_critic is not None:
            broadcast_command({"batch": None, "critic": True, "checkpoint": ("save", str(folder))})
            self.rank_critic.save_state(folder)
            return
        if self.ranks is None:
            raise RuntimeError(f"{self.node.name}: runs on one rank; its optimizer state is saved whole")
        broadcast_command({"batch": None, "checkpoint": ("save", str(folder))})
        self.ranks.save_state(folder)

    def load_checkpoint(self, folder: Path, optimizer_state: dict | None, world_size: int = 1) -> None:
        """Continue from a checkpoint written by a train_step of ``world_size`` ranks, on this
        train_step's ranks whatever their number and strategy (``runtime.reshard``): the weights
        :meth:`save` wrote to ``folder`` and the optimizer's ``state_dict`` (``optimizer_state``)
        when one process wrote it, the shards :meth:`save_sharded` wrote to ``folder/trainer_dcp``
        when several did (bit for bit either way: fp32 weights and moments are stored as they are).

        Raises:
            RuntimeError: weights that do not fit the model (torch names the keys), or a
                ``trainer_dcp/`` of other tensors (DCP names them).
        """
        from runtime.checkpoint import SHARDED_DIR

        if self.rank_critic is not None:  # the checkpoint's critic into the ranks' shards, then rank 0's copy
            command = ("load", str(folder / SHARDED_DIR)) if world_size > 1 else ("whole", str(folder), self.node.name)
            broadcast_command({"batch": None, "critic": True, "checkpoint": command})
            if world_size > 1:
                self.rank_critic.load_state(folder / SHARDED_DIR)
            else:
                self.rank_critic.load_whole(folder, optimizer_state)
            self.rank_critic.gather_into(self.model)
            return
        if self.ranks is not None:
            command = ("load", str(folder), world_size, self.node.name)
            broadcast_command({"batch": None, "checkpoint": command})
            self.ranks.load_state(*command[1:])
            return
        if world_size > 1:  # several ranks wrote it, this process loads the whole tensors
            from runtime.reshard import load_sharded

            load_sharded(self.model, self.optimizer, folder / SHARDED_DIR)
            return
        if self.critic:
            weights = type(self.model).load(folder).state_dict()
        else:
            from runtime.model_source import load_pretrained

            weights = load_pretrained(folder)[0].state_dict()
        self.model.load_state_dict(weights, strict=True)
        self.optimizer.load_state_dict(with_fused(optimizer_state, FUSED_ADAMW))


def algorithm_scaler_slots(algorithm: BaseAlgorithm) -> dict[str, tuple[object, str]]:
    """Role -> (owner, attribute) of a policy algorithm's fp16 loss scalers (its own critic's too)."""
    return {"policy": (algorithm, "loss_scaler"), "critic": (algorithm, "critic_loss_scaler")}


def load_loss_scales(state: dict, slots: dict[str, tuple[object, str]], device: str) -> None:
    """Set each role's loss scale of ``state`` (``TrainStepExecutor.checkpoint_state``) on its
    owner's attribute in ``slots`` (role -> (owner, attribute)): a new ``LossScaler`` on
    ``device`` continuing the saved scale (on one rank, or on each rank of a multi-rank trainer)."""
    for role, saved in state.items():
        owner, name = slots[role]
        scaler = LossScaler(device)
        scaler.load_state_dict(saved)
        setattr(owner, name, scaler)
