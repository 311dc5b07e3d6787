"""A critic's train_step on the ranks of the RL trainer (PPO's value model), under dp, tp, cp, pp and ep.

Owns one rank's share of the critic: the value model (``areal_flow.models.critic``) with its
backbone's linears and embedding split over the trainer's ``tp`` ranks by the policy's
tensor-parallel plan (Megatron column/row split: ``tensor_parallel.apply_tensor_parallel_backbone``),
its scalar head ``Linear(hidden, 1)`` and RMSNorm weights whole on every TP rank (they read the
replicated hidden states, so their gradients are equal there), its sequences cut into chunks over the ``cp`` ranks
(:class:`ChunkValues`: Ulysses attention, a whole-row loss, as the policy's ``rl_context``), all
of it sharded with FSDP2 over the ``dp x cp`` ranks (ZeRO-3, gradients summed:
``runtime.parallel.fsdp``), and its AdamW state;
and the step that makes the gradient that of the single-process critic's loss
(``areal_flow.algorithms.critic_update``): every rank takes the ``B / dp`` contiguous rows of
its DP coordinate (the TP and CP ranks of one DP coordinate the same rows, computing one model
between them), the step's normalisers (valid tokens and sequences summed, longest response maxed) are
all-reduced over the ``dp`` ranks first, so each DP rank's clipped value loss is its share of the
global loss and FSDP's sum of the ranks' gradients is the global gradient; the norm it is
clipped to counts every gradient once over the ranks holding pieces of it
(``runtime.parallel.grad_norm``).

Rank 0 of the trainer keeps a whole copy of the critic besides its shard (the one the
``advantage`` node reads for GAE's values, and the one saved): after every step the ranks'
shards are gathered into it (:meth:`RankCritic.gather_into`), so the values of the next step
are those one process with these weights gives, bit for bit.

Under ``pp`` each rank keeps one stage of the critic (``parallel.critic_pipeline``: the
policy's stage split and 1F1B schedule, the value loss on the last stage), FSDP-sharded over
``dp``; its micro-batches are made small enough that there are at least ``pp``, the metrics come
from the last stage, and each later stage's first rank sends its gathered weights to rank 0.
Under ``ep`` (over the ``dp`` ranks, a MoE backbone) each rank keeps ``n_experts / ep`` experts of
every MoE layer (``parallel.expert_parallel``: tokens dispatched by all-to-all, the experts kept
out of FSDP, their gradients summed over their ``edp`` replicas before the clip).
What this module cannot run (``pp`` with ``tp`` or ``cp``, ``ep`` with ``pp``, ``tp`` or ``cp``)
is refused by ``compiler.executable`` (``critic-parallel``, ``CRITIC_APART``, and the policy's
rules) before any process starts, and by :meth:`RankCritic.build`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import register_fsdp_forward_method

from areal_flow.algorithms.aggregation import step_normalisers
from areal_flow.algorithms.config import LossConfig
from areal_flow.algorithms.critic_update import critic_update, finish_critic_step
from areal_flow.algorithms.loss_scale import LossScaler, fp16_autocast
from areal_flow.algorithms.step_metrics import StepMetrics
from areal_flow.models.critic import ValueModel
from compiler.executable import CRITIC_APART
from compiler.strategy import ParallelStrategy
from runtime.executors.train_settings import TrainSettings, micro_batch_size
from runtime.parallel import signed_objects
from runtime.parallel.context_parallel import apply_context_parallel, gather_sequence
from runtime.parallel.critic_pipeline import ValuePipeline, split_value_stage
from runtime.parallel.expert_parallel import apply_expert_parallel, reduce_expert_gradients
from runtime.parallel.fsdp import apply_fsdp
from runtime.parallel.grad_norm import clip_grad_norm
from runtime.parallel.mesh import dp_cp_mesh, expert_mesh
from runtime.parallel.model_parts import SkippedLayer
from runtime.parallel.tensor_parallel import apply_tensor_parallel_backbone, replicate_unsharded
from runtime.parallel.weight_sync import full_named_tensors
from runtime.weights import DEFAULT_BUCKET_BYTES
from runtime.reshard import FLAT, experts_as_dtensors, load_sharded, load_whole_into_ranks

CRITIC_KEYS = ("input_ids", "attention_mask", "loss_mask", "values", "returns")
"""The batch tensors a critic step reads (``[B, T]`` each)."""


@dataclass
class CriticExperts:
    """A critic's expert parallelism on this rank: its expert parameters (``n_experts / ep`` of
    each MoE layer, in model order), the ``edp`` mesh of their replicas and the ``ep`` mesh they
    are split over."""

    params: list[torch.nn.Parameter]
    edp_mesh: DeviceMesh
    ep_mesh: DeviceMesh


@dataclass
class RankCritic:
    """One rank's shard of the critic and its optimizer.

    Attributes:
        module: the ``ValueModel``, TP-split over ``tp``, its attention context-parallel over
            ``cp``, FSDP2-sharded over ``dp x cp``.
        optimizer: AdamW over its shards. loss_cfg: the plan's loss config of the critic's
            train_step (``value_clip_eps``, ``loss_agg_mode``, ``loss_agg_norm_length``).
        max_grad_norm: clipping norm. strategy: the trainer's (the policy train_step's).
        dp_mesh: the trainer's 1-D ``dp`` mesh (the ranks holding different rows).
        chunks: under ``cp``, the values of whole rows from this rank's sequence chunk.
        pipeline: under ``pp``, this rank's stage's passes (``module`` is then a ``ValueStage``).
        experts: under ``ep``, the experts this rank holds.
        scaler: under fp16 autocast (``model.dtype=float16``) the critic's dynamic loss scale,
            made at the first fp16 step, an overflow on any rank counting on all
            (``areal_flow.algorithms.loss_scale``); None before (and in fp32, bf16).
    """

    module: ValueModel
    optimizer: torch.optim.Optimizer
    loss_cfg: LossConfig
    max_grad_norm: float
    strategy: ParallelStrategy
    dp_mesh: DeviceMesh
    chunks: "ChunkValues | None" = None
    pipeline: ValuePipeline | None = None
    experts: CriticExperts | None = None
    scaler: LossScaler | None = None

    @classmethod
    def build(cls, spec: TrainSettings, mesh: DeviceMesh, strategy: ParallelStrategy,
              device_type: str = "cpu") -> "RankCritic":
        """The critic of ``spec`` (its backbone from ``spec.model_folder``, its head seeded with
        ``spec.seed``, as ``WorkerContext.model`` builds it on one process), split over ``mesh``
        (the trainer's ``[pp, dp, cp, tp]`` mesh of ``strategy``, ``runtime.parallel.mesh``).
        Every rank calls it (collectives); under CUDA the rank's device is set already.

        Raises:
            ValueError: ``strategy`` has two degrees of ``compiler.executable.CRITIC_APART`` above 1
                (names them).
        """
        both = next((pair for pair in CRITIC_APART if all(getattr(strategy, d) > 1 for d in pair)), None)
        if both:
            raise ValueError(f"a critic on the trainer's ranks cannot run {both[0]} with {both[1]}; strategy "
                             f"{strategy.short()} has both > 1")
        model = ValueModel.from_policy(spec.model_folder, seed=spec.seed)
        if device_type == "cuda":
            model = model.cuda()
        model.train()
        module, pipeline, experts = model, None, None
        if strategy.pp_enabled:
            module = split_value_stage(model, mesh["pp"])
        layers = [layer for layer in model.backbone.layers if not isinstance(layer, SkippedLayer)]
        if strategy.tp_enabled:
            apply_tensor_parallel_backbone(model.backbone, mesh["tp"])
        if strategy.ep_enabled:
            expert_meshes = expert_mesh(mesh, strategy)
            experts = CriticExperts(apply_expert_parallel(model, expert_meshes["ep"], layers),
                                    expert_meshes["edp"], expert_meshes["ep"])
        if strategy.cp_enabled:
            apply_context_parallel(model.backbone, mesh["cp"])
        if strategy.dp * strategy.cp > 1:
            apply_fsdp(module, dp_cp_mesh(mesh), ignored_params=set(experts.params) if experts else None,
                       layers=layers)
            if strategy.cp_enabled:  # ChunkValues' entry, not forward: FSDP gathers the root's shards for it
                register_fsdp_forward_method(model, "values_after")
        elif strategy.tp_enabled:  # the head and norms: replicated DTensors, as FSDP would make them otherwise
            replicate_unsharded(model, mesh["tp"], layers=layers)
        if strategy.pp_enabled:
            pipeline = ValuePipeline(module, mesh["pp"])
        optimizer = torch.optim.AdamW(module.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
        chunks = ChunkValues(model, mesh["cp"]) if strategy.cp_enabled else None
        return cls(module, optimizer, spec.loss_config(), spec.max_grad_norm, strategy, mesh["dp"], chunks,
                   pipeline, experts)

    def step(self, batch: dict[str, torch.Tensor], micro_batches: int) -> dict[str, float]:
        """One optimizer step on this rank's rows of the step's ``batch`` (``[B, T]`` tensors
        ``CRITIC_KEYS``, the same on every rank), in ``micro_batches`` micro-batches per rank.

        Returns:
            ``value_loss`` (the global loss: the ranks' shares summed), ``value_clip_frac``
            (over the step's valid tokens) and ``critic_grad_norm`` (global, before clipping);
            under fp16 also ``critic_loss_scale`` and ``critic_loss_scale_overflow``
            (``critic_update``'s); the same on every rank (under ``pp``: the last stage's,
            where the loss runs).

        Raises:
            ValueError: ``B`` not divisible by ``dp``; under ``pp`` a row with padding before its
                last real token (stages attend causally only).
        """
        rows, dp = batch["input_ids"].shape[0], self.dp_mesh.size()
        if rows % dp:
            raise ValueError(f"a critic step of {rows} sequences does not divide by dp={dp}")
        share = rows // dp
        start = self.dp_mesh.get_local_rank() * share
        device = next(self.module.parameters()).device
        local = {k: batch[k][start:start + share].to(device) for k in CRITIC_KEYS}
        mask = local["loss_mask"].bool()
        n_tokens, n_seqs, longest = step_normalisers(mask)
        group = self.dp_mesh.get_group()
        counts = torch.tensor([n_tokens, n_seqs], dtype=torch.int64, device=device)
        dist.all_reduce(counts, group=group)
        longest_t = torch.tensor([longest], dtype=torch.int64, device=device)
        dist.all_reduce(longest_t, op=dist.ReduceOp.MAX, group=group)
        norm = dict(n_tokens=int(counts[0]), n_seqs=int(counts[1]),
                    norm_length=self.loss_cfg.loss_agg_norm_length or max(int(longest_t), 1))
        size = micro_batch_size(rows, dp, micro_batches)  # every rank runs as many micro-batches (equal shares)
        if self.pipeline is not None:  # at least one micro-batch per stage (1F1B)
            size = min(size, math.ceil(share / self.strategy.pp))
        slices = [slice(i, min(i + size, share)) for i in range(0, share, size)]
        if self.scaler is None and fp16_autocast(device.type):
            self.scaler = LossScaler(device.type)
        scaler = self.scaler if fp16_autocast(device.type) else None
        if self.pipeline is None:
            stats = critic_update(self.chunks or self.module, self.optimizer, local, mask, norm, self.loss_cfg,
                                  slices, self.max_grad_norm, clip=self._clip, scaler=scaler)
        else:
            require_right_padded(local["attention_mask"])
            metrics = StepMetrics()
            self.optimizer.zero_grad(set_to_none=True)
            self.pipeline.forward_backward(local, mask, norm, self.loss_cfg, slices, metrics,
                                           scale=scaler.scaled if scaler is not None else None)
            stats = finish_critic_step(self.module.parameters(), self.optimizer, norm, self.max_grad_norm, metrics,
                                       self._clip, scaler)
        totals = torch.tensor([stats.get("value_loss", 0.0), stats.get("value_clip_frac", 0.0) * n_tokens, n_tokens],
                              dtype=torch.float64, device=device)
        dist.all_reduce(totals, group=group)
        scale_stats = {k: stats[k] for k in ("critic_loss_scale", "critic_loss_scale_overflow") if k in stats}
        stats = {"value_loss": float(totals[0]), "value_clip_frac": float(totals[1] / totals[2].clamp(min=1.0)),
                 "critic_grad_norm": stats["critic_grad_norm"], **scale_stats}
        return self.pipeline.broadcast_from_last_stage(stats) if self.pipeline is not None else stats

    def _clip(self, parameters, max_norm: float) -> torch.Tensor:
        """``critic_update``'s clip on this rank: the experts' gradients summed over their
        ``edp`` replicas first (FSDP does not see them), then the global norm over the ranks
        holding pieces of the gradient (``grad_norm.clip_grad_norm``: the ``ep`` group's expert
        blocks, the ``pp`` stages)."""
        experts = self.experts
        if experts is not None:
            reduce_expert_gradients(experts.params, experts.edp_mesh)
        return clip_grad_norm(parameters, max_norm, experts=experts.params if experts else (),
                              ep_group=experts.ep_mesh.get_group() if experts else None,
                              pp_group=self.pipeline.group if self.pipeline is not None else None)

    def gather_into(self, whole: torch.nn.Module | None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Copy the full parameters into ``whole`` (rank 0's unsharded critic; ``None`` on the
        other ranks), one parameter at a time. Every rank must call it (an all-gather per
        parameter). Under ``pp`` each stage gathers its own parameters and its rank in rank 0's
        pipeline group sends them to rank 0 on the CPU, in buckets of about ``bucket_bytes``.

        Raises:
            KeyError: ``whole`` lacks a parameter of the critic (not a ``ValueModel`` of this backbone).
        """
        params = dict(whole.named_parameters()) if whole is not None else None
        group = self.pipeline.group if self.pipeline is not None else None
        sends = group is not None and dist.get_global_rank(group, 0) == 0 and dist.get_rank() != 0
        bucket, filled = {}, 0
        with torch.no_grad():
            for name, tensor in full_named_tensors(self.module):
                if params is not None:
                    params[name].copy_(tensor)
                elif sends:
                    bucket[name], filled = tensor.cpu(), filled + tensor.numel() * tensor.element_size()
                    if filled >= bucket_bytes:
                        signed_objects.send(bucket, 0, "critic_buckets")
                        bucket, filled = {}, 0
            if sends:
                if bucket:
                    signed_objects.send(bucket, 0, "critic_buckets")
                signed_objects.send(None, 0, "critic_buckets")
            if params is not None and group is not None:
                for stage in range(1, dist.get_world_size(group)):
                    source = dist.get_global_rank(group, stage)
                    while (received := signed_objects.recv(source, "critic_buckets")) is not None:
                        for name, tensor in received.items():
                            params[name].copy_(tensor)

    def save_state(self, folder: str | Path) -> None:
        """Save this rank's shards of the critic and its AdamW state to ``folder`` with
        ``torch.distributed.checkpoint`` (the layout of ``RankTrainer.save_state``: keys
        ``model`` and ``optimizer``, the optimizer state flattened). Every rank calls it."""
        model_state, optim_state = get_state_dict(self.module, self.optimizer, options=FLAT)
        experts_as_dtensors(self.module, self._experts(), model_state, optim_state)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder))

    def load_whole(self, folder: str | Path, optimizer_state: dict) -> None:
        """Load a critic one process wrote (``folder``: its ``ValueModel.save`` folder;
        ``optimizer_state``: its AdamW ``state_dict``) into this rank's shards (every rank calls
        it; ``runtime.reshard.load_whole_into_ranks``).

        Raises:
            FileNotFoundError: ``folder`` holds no saved critic; those of ``load_whole_into_ranks``.
        """
        load_whole_into_ranks(self.module, self.optimizer, folder, optimizer_state, load=ValueModel.load)

    def load_state(self, folder: str | Path) -> None:
        """Load the shards :meth:`save_state` wrote to ``folder`` (by any number of ranks) into
        this rank's (every rank calls it; ``runtime.reshard.load_sharded``).

        Raises:
            FileNotFoundError / RuntimeError (from DCP): no DCP checkpoint in ``folder``, or one
                of other tensors.
        """
        load_sharded(self.module, self.optimizer, folder, experts=self._experts())

    def _experts(self) -> tuple[list, DeviceMesh] | None:
        """Under ep: this rank's expert parameters and the ep mesh (``reshard.experts_as_dtensors``)."""
        return (self.experts.params, self.experts.ep_mesh) if self.experts is not None else None


class ChunkValues(torch.nn.Module):
    """The critic's values of whole rows under context parallelism, each ``cp`` rank computing one
    chunk (what ``critic_update`` calls in place of the ``ValueModel``).

    As the policy's ``rl_context``: rank ``r`` runs the backbone (Ulysses attention:
    ``context_parallel``) on positions ``[r * c, (r + 1) * c)`` of every row (``c = ceil(width /
    cp)``, the width padded to ``c * cp``), the head on each, then the chunks are gathered into
    whole rows (``gather_sequence``: its backward hands each rank its own chunk's gradient, so
    FSDP's sum over the ``dp_cp`` ranks counts it once) and shifted as ``ValueModel.forward``
    shifts them; every cp rank then computes the same whole-row loss. Attention is causal only,
    exact on the real tokens of right-padded rows.

    Args:
        model: this rank's ``ValueModel`` (context parallel, FSDP-sharded over ``dp_cp``).
        cp_mesh: the trainer's 1-D ``cp`` mesh.
    """

    def __init__(self, model: ValueModel, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.model = model
        self.group, self.cp, self.rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Values ``[batch, seq]`` float32 of ``input_ids [batch, seq]`` (``ValueModel``'s layout).
        Every cp rank calls it with the same rows (collectives).

        Raises:
            ValueError: a row of ``attention_mask`` with padding before its last real token.
        """
        width = input_ids.shape[1]
        require_right_padded(attention_mask)
        chunk = math.ceil(width / self.cp)
        padded = torch.nn.functional.pad(input_ids, (0, chunk * self.cp - width))
        start = self.rank * chunk
        positions = torch.arange(start, start + chunk, device=input_ids.device).unsqueeze(0)
        after = self.model.values_after(padded[:, start:start + chunk], position_ids=positions)  # [b, chunk]
        whole = gather_sequence(after, self.group, self.rank)[:, :width]
        return torch.nn.functional.pad(whole[:, :-1], (1, 0))


def require_right_padded(attention_mask: torch.Tensor) -> None:
    """Check that every row of ``attention_mask [batch, seq]`` is right-padded (real tokens
    first): context-parallel chunks and pipeline stages attend causally only, which is exact on
    every real token of such a row.

    Raises:
        ValueError: a row with padding before its last real token (names the row).
    """
    width = attention_mask.shape[1]
    lengths = attention_mask.sum(dim=1, keepdim=True)
    right = torch.arange(width, device=attention_mask.device).unsqueeze(0) < lengths
    bad = (right != attention_mask.bool()).any(dim=1).nonzero()
    if len(bad):
        raise ValueError(f"row {int(bad[0])} has padding inside its first {int(lengths[bad[0]])} tokens: a critic "
                         "under context or pipeline parallelism needs right-padded rows (real tokens first)")
