"""Compose the parallelisms of a ``ParallelStrategy`` on a ``transformers`` causal LM.

Fixed order, each step a small function of its own module:

1. pipeline split (``pipeline.split_stage``): keep this rank's stage (and a group for a tied
   embedding's two copies, ``pipeline.tied_embedding_group``);
2. tensor parallel (``tensor_parallel.apply_tensor_parallel``) over ``"tp"``;
3. expert parallel (``expert_parallel.apply_expert_parallel``) over ``"ep"``;
4. context parallel (``context_parallel.apply_context_parallel``) over ``"cp"``;
5. activation checkpointing (``activation_checkpoint``);
6. FSDP (``fsdp.apply_fsdp``) over the flattened ``"dp_cp"`` ranks, experts excluded;
7. the pipeline schedule around the finished stage.

The result, :class:`ParallelModel`, is what ``train_step`` and ``weight_sync`` take.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from compiler.strategy import ParallelStrategy
from runtime.parallel.activation_checkpoint import apply_activation_checkpointing
from runtime.parallel.context_parallel import apply_context_parallel
from runtime.parallel.expert_parallel import apply_expert_parallel
from runtime.parallel.fsdp import apply_fsdp
from runtime.parallel.loss import TokenMeanLoss
from runtime.parallel.mesh import dp_cp_mesh, expert_mesh
from runtime.parallel.pipeline import build_schedule, split_stage, stage_layer_ranges, tied_embedding_group
from runtime.parallel.tensor_parallel import apply_tensor_parallel


@dataclass(frozen=True)
class ParallelConfig:
    """How to run a strategy, beyond its degrees.

    Attributes:
        n_microbatches: micro-batches per optimizer step (gradient accumulation,
            or pipeline micro-batches); the local batch must divide by it. ``None``: no
            pipeline schedule is built (the caller drives the stage: the RL trainer builds
            one per batch shape, ``rl_pipeline``).
        pp_schedule: ``"gpipe"`` or ``"1f1b"``.
        layers_per_stage: the plan's layer split over pipeline stages (default equal).
        activation_checkpointing: recompute each decoder layer in backward.
    """

    n_microbatches: int | None = 1
    pp_schedule: str = "1f1b"
    layers_per_stage: list[int] | None = None
    activation_checkpointing: bool = False


@dataclass
class ParallelModel:
    """A model parallelized on this rank, with what a training step needs.

    Attributes:
        module: the ``*ForCausalLM`` (or its pipeline stage) after all wrappers.
        strategy, mesh, config: as given to :func:`parallelize`.
        loss: the step's token-mean loss (its global token count is set per step).
        schedule: the pipeline schedule when ``pp > 1`` and ``config.n_microbatches`` is set, else ``None``.
        expert_params: this rank's expert parameters (EP), in model order.
        edp_mesh, ep_mesh: the expert data-parallel / expert-parallel meshes (EP only).
        tied_group: the first and last pipeline stages of this rank's coordinate, when they
            hold the two copies of a tied embedding (``pipeline.tied_embedding_group``), else None.
    """

    module: nn.Module
    strategy: ParallelStrategy
    mesh: DeviceMesh
    config: ParallelConfig
    loss: TokenMeanLoss
    schedule: PipelineScheduleSingle | None = None
    expert_params: list[nn.Parameter] = field(default_factory=list)
    edp_mesh: DeviceMesh | None = None
    ep_mesh: DeviceMesh | None = None
    tied_group: dist.ProcessGroup | None = None

    @property
    def coordinate(self) -> dict[str, int]:
        """This rank's index along ``pp``, ``dp``, ``cp``, ``tp``."""
        return dict(zip(self.mesh.mesh_dim_names, self.mesh.get_coordinate()))


def parallelize(
    causal_lm: nn.Module, strategy: ParallelStrategy, mesh: DeviceMesh, config: ParallelConfig = ParallelConfig()
) -> ParallelModel:
    """Apply ``strategy`` to ``causal_lm`` (modified in place) on this rank.

    Every rank calls this with an identical model (same weights, already on its
    device: CPU for gloo, its CUDA device for NCCL) and the mesh
    from ``mesh.build_device_mesh(strategy, ...)``. Validate the strategy with
    ``validate.validate_strategy_for_model`` before the processes start.

    Raises:
        ValueError: a bad layer split, schedule name or micro-batch count, or
            ``ep > 1`` on a model without MoE layers.
    """
    if config.n_microbatches is not None and config.n_microbatches < 1:
        raise ValueError(f"n_microbatches={config.n_microbatches}: must be >= 1")
    loss = TokenMeanLoss()
    module = causal_lm
    tied_group = None
    if strategy.pp_enabled:
        ranges = stage_layer_ranges(len(causal_lm.model.layers), strategy.pp, config.layers_per_stage)
        stage = mesh["pp"].get_local_rank()
        module = split_stage(causal_lm, stage, ranges[stage], strategy.pp)
        tied_group = tied_embedding_group(mesh) if module.tied_embeddings else None
    if strategy.tp_enabled:
        apply_tensor_parallel(module, mesh["tp"])
    expert_params: list[nn.Parameter] = []
    edp_mesh = ep_mesh = None
    if strategy.ep_enabled:
        experts_mesh = expert_mesh(mesh, strategy)
        edp_mesh, ep_mesh = experts_mesh["edp"], experts_mesh["ep"]
        expert_params = apply_expert_parallel(module, ep_mesh)
    if strategy.cp_enabled:
        apply_context_parallel(module, mesh["cp"])
    if config.activation_checkpointing:
        apply_activation_checkpointing(module)
    if strategy.dp * strategy.cp > 1:
        apply_fsdp(module, dp_cp_mesh(mesh), ignored_params=set(expert_params))
    schedule = None
    if strategy.pp_enabled and config.n_microbatches is not None:
        device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
        schedule = build_schedule(module, mesh["pp"], device, config.n_microbatches, loss, config.pp_schedule)
    return ParallelModel(module, strategy, mesh, config, loss, schedule, expert_params, edp_mesh, ep_mesh, tied_group)
