"""A value model (PPO's critic) split into pipeline stages, and its step through the 1F1B schedule.

Owns the critic's share of pipeline parallelism; the stage split and the schedule kind are the
policy's (``pipeline``, ``rl_pipeline``). Each ``pp`` rank keeps one stage of the
``ValueModel`` (``areal_flow.models.critic``) with the full model's parameter names
(``backbone.layers.3...``, ``head.weight``): a contiguous block of decoder layers (the others
become ``SkippedLayer``), the embedding on the first stage, the final norm and the scalar head on
the last. The last stage's output is ``values_after`` (``[rows, width]`` float32, unshifted).

A step's micro-batches (``rows`` sequences each, the step's longest row wide; a shorter last one
padded with empty rows) are stacked into one ``[n * rows, width]`` batch that
``Schedule1F1B`` (Narayanan et al. 2019, PipeDream-Flush; ``scale_grads=False``: the loss is
already divided by the step's normalisers) splits back into ``n``; the target it hands the loss
function is each micro-batch's row indices. The last stage shifts the values as
``ValueModel.forward`` does, keeps the micro-batch's real rows and width
(``micro_batches.trimmed_width``, as one process trims) and returns their clipped value loss
(``critic_update.micro_batch_value_loss``). Stages run causal attention only, exact on every real
token of right-padded rows. A value model has no tied matrix: the gradient norm adds the stages'
squares over the pipeline group (``grad_norm``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from areal_flow.algorithms.config import LossConfig
from areal_flow.algorithms.critic_update import micro_batch_value_loss
from areal_flow.algorithms.micro_batches import trimmed_width
from areal_flow.algorithms.step_metrics import StepMetrics
from runtime.parallel import signed_objects
from runtime.parallel.model_parts import SkippedLayer
from runtime.parallel.pipeline import stage_layer_ranges


class ValueStage(nn.Module):
    """One pipeline stage of a ``ValueModel``, with its parameter names.

    ``forward(x)``: the first stage takes ``input_ids [rows, width]``, the others hidden states
    ``[rows, width, hidden]``; the last returns the head's values ``[rows, width]`` float32
    (``ValueModel.values_after``), the others hidden states.
    """

    def __init__(self, value_model: nn.Module, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.backbone = value_model.backbone
        if is_last:
            self.head = value_model.head
        self.config = value_model.backbone.config
        self.is_first, self.is_last = is_first, is_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        hidden = self.backbone(**inputs, position_ids=positions, use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1).float() if self.is_last else hidden


def split_value_stage(value_model: nn.Module, pp_mesh: DeviceMesh) -> ValueStage:
    """Keep this rank's stage of ``value_model`` (modified in place; equal blocks of layers,
    ``pipeline.stage_layer_ranges``).

    Raises:
        ValueError: ``pp`` does not divide the decoder layers into positive blocks.
    """
    layers, pp, stage = value_model.backbone.layers, pp_mesh.size(), pp_mesh.get_local_rank()
    held = stage_layer_ranges(len(layers), pp)[stage]
    for index in range(len(layers)):
        if index not in held:
            layers[index] = SkippedLayer()
    if stage > 0:
        value_model.backbone.embed_tokens = None
    if stage < pp - 1:
        value_model.backbone.norm = nn.Identity()
    return ValueStage(value_model, stage == 0, stage == pp - 1)


class ValuePipeline:
    """The critic step's forward and backward passes through this rank's stage.

    Every rank of the pipeline calls :meth:`forward_backward` with the same arguments, in the
    same order (the schedule's point-to-point exchanges over ``pp_mesh``).

    Args:
        stage: this rank's :class:`ValueStage` (FSDP-sharded over ``dp`` or not).
        pp_mesh: the trainer's 1-D ``pp`` mesh.
    """

    def __init__(self, stage: ValueStage, pp_mesh: DeviceMesh) -> None:
        self.stage, self.pp_mesh = stage, pp_mesh
        self.group = pp_mesh.get_group()
        self._built: tuple[tuple[int, int, int], Schedule1F1B] | None = None
        self._loss = None

    def _schedule(self, rows: int, width: int, n_micro: int, device: torch.device) -> Schedule1F1B:
        """The schedule for ``n_micro`` micro-batches of ``[rows, width]`` tokens (cached per shape)."""
        key = (rows, width, n_micro)
        if self._built is not None and self._built[0] == key:
            return self._built[1]
        dtype = next(self.stage.parameters()).dtype  # the residual stream: fp32 master weights
        hidden = torch.empty((rows, width, self.stage.config.hidden_size), dtype=dtype, device="meta",
                             requires_grad=True)
        inputs = torch.empty((rows, width), dtype=torch.int64, device="meta") if self.stage.is_first else hidden
        outputs = torch.empty((rows, width), dtype=torch.float32, device="meta") if self.stage.is_last else hidden
        stage = PipelineStage(self.stage, self.pp_mesh.get_local_rank(), self.pp_mesh.size(), device,
                              input_args=inputs, output_args=outputs, group=self.group)
        schedule = Schedule1F1B(stage, n_microbatches=n_micro, loss_fn=lambda out, target: self._loss(out, target),
                                scale_grads=False)
        self._built = (key, schedule)
        return schedule

    def forward_backward(self, batch: dict[str, torch.Tensor], mask: torch.Tensor, norm: dict, loss_cfg: LossConfig,
                         slices: list[slice], metrics: StepMetrics,
                         scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Accumulate the gradient of the clipped value loss of ``batch``'s micro-batches
        ``slices`` (``batch``, ``mask``, ``norm``, ``loss_cfg``: as ``critic_update``'s) into the
        stage's parameters; the last stage adds ``value_loss`` and ``value_clip_frac`` to
        ``metrics``. ``scale``: under fp16, the loss scale's ``scaled`` (``LossScaler``): what
        each micro-batch back-propagates is ``scale(loss)`` (the metrics keep the loss itself).

        Raises:
            ValueError: fewer micro-batches than stages (1F1B runs at least one per stage).
        """
        n_micro, pp = len(slices), self.pp_mesh.size()
        if n_micro < pp:
            raise ValueError(f"the 1F1B schedule needs at least pp={pp} micro-batches, got {n_micro}")
        ids, attn = batch["input_ids"], batch["attention_mask"]
        rows = max(sl.stop - sl.start for sl in slices)
        width = max(trimmed_width(attn[sl]) for sl in slices)
        stacked = torch.zeros((n_micro * rows, width), dtype=ids.dtype, device=ids.device)
        target = torch.full((n_micro * rows,), -1, dtype=torch.int64, device=ids.device)
        for i, sl in enumerate(slices):
            count = sl.stop - sl.start
            stacked[i * rows: i * rows + count] = ids[sl, :width]
            target[i * rows: i * rows + count] = torch.arange(sl.start, sl.stop, device=ids.device)

        def loss(values_after: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
            real = picked[picked >= 0]
            w = trimmed_width(attn[real])
            values = nn.functional.pad(values_after[: len(real), : w - 1], (1, 0))  # ValueModel.forward's shift
            loss = micro_batch_value_loss(values, batch, mask, real, norm, loss_cfg, metrics)
            return loss if scale is None else scale(loss)

        schedule = self._schedule(rows, width, n_micro, ids.device)
        self._loss = loss
        try:
            args = (stacked,) if self.stage.is_first else ()
            schedule.step(*args, target=target if self.stage.is_last else None, return_outputs=False)
        finally:
            self._loss = None

    def broadcast_from_last_stage(self, stats: dict[str, float]) -> dict[str, float]:
        """The last stage's ``stats`` on every stage (a collective of the pp group)."""
        last = dist.get_global_rank(self.group, self.pp_mesh.size() - 1)
        return signed_objects.broadcast(stats, src=last, channel="critic_pp_stats", group=self.group)
