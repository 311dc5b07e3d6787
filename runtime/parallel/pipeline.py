"""Pipeline parallelism with ``torch.distributed.pipelining``: stage split and schedule.

Each pipeline rank builds the full ``*ForCausalLM`` and keeps only its stage: a
contiguous block of decoder layers (others become ``SkippedLayer``), the
embedding on the first stage, the final norm and LM head on the last. Parameter
names stay those of the full model, so gathered weights and gradients need no
renaming.

Schedules: GPipe (Huang et al. 2019: all micro-batch forwards, then all
backwards; activation memory of ``n_microbatches`` micro-batches) and 1F1B
(Narayanan et al. 2019, PipeDream-Flush: one forward, one backward in steady
state; activations of at most ``pp`` micro-batches in flight). Both are
created with ``scale_grads=False``: by default they divide gradients by the
number of micro-batches, but ``loss.TokenMeanLoss`` already divides each
micro-batch's token sum by the step's global token count.

Tied word embeddings (the embedding matrix is also the LM head, as in the tiny presets and
Qwen2.5-0.5B/1.5B): the first stage keeps it as the embedding and the last as the LM head,
two copies of one parameter, as Megatron-LM does (Shoeybi et al. 2019; its "embedding group").
Each copy gets the gradient of its own use; :func:`sync_tied_embedding_grads` sums the two
over the first and last stage ranks of the same ``dp``/``cp``/``tp`` coordinate, so both hold
the gradient of the tied parameter and the identical optimizer updates keep them equal.

Attention masks: stages run the decoder with no padding mask, only the causal
one. For right-padded batches this is exact on every valid token (a valid
token never attends to a later, padded one); padded positions carry no loss.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from runtime.parallel.model_parts import SkippedLayer

SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def stage_layer_ranges(n_layers: int, pp: int, layers_per_stage: list[int] | None = None) -> list[range]:
    """Layer index ranges of each stage.

    Args:
        n_layers: decoder layers of the model.
        pp: pipeline degree.
        layers_per_stage: the plan's split (e.g. ``[3, 5]``); default equal blocks.

    Raises:
        ValueError: the split does not have ``pp`` positive entries summing to ``n_layers``.
    """
    counts = layers_per_stage or [n_layers // pp] * pp
    if len(counts) != pp or sum(counts) != n_layers or min(counts) < 1:
        raise ValueError(f"layers_per_stage={counts}: need {pp} positive counts summing to {n_layers} layers")
    starts = [sum(counts[:i]) for i in range(pp)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


class PipelineStageModel(nn.Module):
    """One stage of a ``*ForCausalLM``, with the full model's parameter names.

    ``forward(x)``: first stage ``x`` is ``input_ids`` ``[micro_batch, seq]``;
    later stages take hidden states ``[micro_batch, seq, hidden]``. The last
    stage returns logits ``[micro_batch, seq - head_from, vocab]`` of positions ``head_from``
    on (the LM head runs on those alone, as ``transformers``' ``logits_to_keep``; default 0:
    every position), others hidden states.
    """

    def __init__(self, causal_lm: nn.Module, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.model = causal_lm.model
        self.lm_head = causal_lm.lm_head
        self.config = causal_lm.config
        self.is_first = is_first
        self.is_last = is_last
        self.tied_embeddings = bool(getattr(causal_lm.config, "tie_word_embeddings", False))
        self.position_offset = 0  # first position of this rank's sequence chunk (context parallelism)
        self.head_from = 0  # first position the last stage's LM head runs on (``rl_pipeline``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        positions = torch.arange(self.position_offset, self.position_offset + seq, device=x.device).unsqueeze(0)
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        hidden = self.model(**inputs, position_ids=positions, use_cache=False).last_hidden_state
        return self.lm_head(hidden[:, self.head_from:] if self.is_last else hidden)


def split_stage(causal_lm: nn.Module, stage_index: int, layer_range: range, n_stages: int) -> PipelineStageModel:
    """Keep only stage ``stage_index``'s parts of ``causal_lm`` (modified in place) and wrap them."""
    layers = causal_lm.model.layers
    for index in range(len(layers)):
        if index not in layer_range:
            layers[index] = SkippedLayer()
    is_first, is_last = stage_index == 0, stage_index == n_stages - 1
    if not is_first:
        causal_lm.model.embed_tokens = None
    if not is_last:
        causal_lm.model.norm = nn.Identity()
        causal_lm.lm_head = nn.Identity()
    return PipelineStageModel(causal_lm, is_first, is_last)


def build_schedule(
    stage_model: PipelineStageModel,
    pp_mesh: DeviceMesh,
    device: torch.device,
    n_microbatches: int,
    loss_fn,
    schedule: str = "1f1b",
) -> PipelineScheduleSingle:
    """A single-stage-per-rank schedule over ``pp_mesh``.

    Args:
        stage_model: this rank's stage (already TP/FSDP-parallelized if wanted).
        pp_mesh: 1-D mesh of the pipeline ranks (stage index = rank in it).
        device: where the stage's activations live.
        n_microbatches: micro-batches per step (the local batch must divide by it).
        loss_fn: ``loss_fn(logits, labels) -> scalar`` on the last stage.
        schedule: ``"gpipe"`` or ``"1f1b"``.

    Raises:
        ValueError: unknown schedule name.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pp schedule {schedule!r}: expected one of {sorted(SCHEDULES)}")
    stage = PipelineStage(
        stage_model, pp_mesh.get_local_rank(), pp_mesh.size(), device, group=pp_mesh.get_group()
    )
    return SCHEDULES[schedule](stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def tied_embedding_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The process group of this rank's first- and last-stage ranks (same ``dp``, ``cp``, ``tp``
    coordinate of the ``[pp, dp, cp, tp]`` mesh), or ``None`` on a middle stage. Every rank
    must call it (it creates one group per coordinate, in the same order everywhere)."""
    ranks = mesh.mesh  # global rank at each [pp, dp, cp, tp] coordinate
    mine = None
    for coordinate in itertools.product(*(range(size) for size in ranks.shape[1:])):
        pair = [int(ranks[(0, *coordinate)]), int(ranks[(-1, *coordinate)])]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


def tied_embedding(stage: PipelineStageModel) -> nn.Parameter | None:
    """This stage's copy of a tied embedding / LM head matrix (``None`` when untied or on a middle stage)."""
    if not stage.tied_embeddings:
        return None
    if stage.is_first:
        return stage.model.embed_tokens.weight
    return stage.lm_head.weight if stage.is_last else None


def sync_tied_embedding_grads(stage: PipelineStageModel, group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of the tied matrix's two copies over ``group`` (:func:`tied_embedding_group`),
    after the step's backward; a no-op for an untied model or a middle stage. Both copies are
    sharded alike (FSDP rows of the same shape, TP vocabulary rows), so local shards are summed."""
    weight = tied_embedding(stage)
    if weight is None:
        return
    if weight.grad is None:  # no token reached it: its share of the sum is 0
        weight.grad = torch.zeros_like(weight)
    grad = weight.grad
    if isinstance(grad, DTensor):
        if grad.placements != weight.placements:  # e.g. TP's embedding gradient comes back unsharded
            weight.grad = grad = grad.redistribute(grad.device_mesh, weight.placements)
        grad = grad.to_local()
    dist.all_reduce(grad, group=group)
