"""One optimizer step of a parallelized causal LM: batch sharding, micro-batches, backward, step.

The loss is the token mean over the whole step (``loss`` module): the global
count of valid tokens is all-reduced over the ``dp_cp`` ranks first, then each
micro-batch's token sum divided by it is back-propagated, so accumulation over
micro-batches, FSDP's gradient sum over ranks and the pipeline schedule all
produce the gradient of the same global mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from runtime.parallel.apply import ParallelModel
from runtime.parallel.context_parallel import sequence_chunk
from runtime.parallel.expert_parallel import reduce_expert_gradients
from runtime.parallel.loss import global_token_count
from runtime.parallel.mesh import dp_cp_mesh
from runtime.parallel.pipeline import sync_tied_embedding_grads


def shard_batch(
    parallel_model: ParallelModel, input_ids: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a global batch: rows of its DP rank, sequence chunk of its CP rank.

    Args:
        input_ids, labels: ``[batch, seq]`` (labels from ``loss.shift_labels``).

    Returns:
        ``([batch/dp, seq/cp], [batch/dp, seq/cp])``; TP and PP ranks of the same
        DP/CP coordinate get the same part.

    Raises:
        ValueError: ``batch`` not divisible by ``dp`` or ``seq`` by ``cp``.
    """
    strategy, coordinate = parallel_model.strategy, parallel_model.coordinate
    if input_ids.shape[0] % strategy.dp:
        raise ValueError(f"batch of {input_ids.shape[0]} sequences must be divisible by dp={strategy.dp}")
    rows = input_ids.shape[0] // strategy.dp
    picked = slice(coordinate["dp"] * rows, (coordinate["dp"] + 1) * rows)
    return tuple(sequence_chunk(t[picked], coordinate["cp"], strategy.cp) for t in (input_ids, labels))


def forward_backward(parallel_model: ParallelModel, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
    """Accumulate the gradient of the step's token-mean loss over this rank's micro-batches.

    Args:
        input_ids, labels: this rank's ``[local_batch, local_seq]`` (see :func:`shard_batch`).

    Returns:
        The global token-mean loss of the step (the same value on every rank).

    Raises:
        ValueError: ``local_batch`` is not divisible by ``n_microbatches``.
        RuntimeError: the step has no valid token.
    """
    pm = parallel_model
    n_micro = pm.config.n_microbatches
    if input_ids.shape[0] % n_micro:
        raise ValueError(f"local batch of {input_ids.shape[0]} must be divisible by n_microbatches={n_micro}")
    data_group = dp_cp_mesh(pm.mesh).get_group()
    pm.loss.n_global_tokens = global_token_count(labels, data_group)
    if pm.loss.n_global_tokens == 0:
        raise RuntimeError("the optimizer step has no valid token (every label is ignored)")
    offset = pm.coordinate["cp"] * input_ids.shape[1]
    if pm.schedule is not None:
        local_loss = _pipeline_forward_backward(pm, input_ids, labels, offset)
        sync_tied_embedding_grads(pm.module, pm.tied_group)
    else:
        local_loss = _accumulate(pm, input_ids, labels, offset)
    if pm.edp_mesh is not None:
        reduce_expert_gradients(pm.expert_params, pm.edp_mesh)
    total = torch.tensor([local_loss], dtype=torch.float64, device=input_ids.device)
    dist.all_reduce(total, group=data_group)
    if pm.strategy.pp_enabled:  # only the last stage holds a loss; the others add 0
        dist.all_reduce(total, group=pm.mesh["pp"].get_group())
    return float(total.item())


def _accumulate(pm: ParallelModel, input_ids: torch.Tensor, labels: torch.Tensor, offset: int) -> float:
    n_micro = pm.config.n_microbatches
    positions = torch.arange(offset, offset + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    local_loss = 0.0
    for index, (ids, targets) in enumerate(zip(input_ids.chunk(n_micro), labels.chunk(n_micro))):
        if isinstance(pm.module, FSDPModule):  # reduce-scatter once, after the last micro-batch
            pm.module.set_requires_gradient_sync(index == n_micro - 1)
        logits = pm.module(input_ids=ids, position_ids=positions, use_cache=False).logits
        loss = pm.loss(logits, targets)
        loss.backward()
        local_loss += loss.item()
    return local_loss


def _pipeline_forward_backward(pm: ParallelModel, input_ids: torch.Tensor, labels: torch.Tensor, offset: int) -> float:
    stage = pm.module
    stage.position_offset = offset
    losses: list[torch.Tensor] = []
    args = (input_ids,) if stage.is_first else ()
    if stage.is_last:
        pm.schedule.step(*args, target=labels, losses=losses, return_outputs=False)  # don't keep the logits
        return float(sum(loss.item() for loss in losses))
    pm.schedule.step(*args, return_outputs=False)
    return 0.0


def train_step(parallel_model: ParallelModel, optimizer: torch.optim.Optimizer, input_ids, labels) -> float:
    """:func:`forward_backward`, then ``optimizer.step()`` and ``zero_grad()``; returns the step's loss."""
    loss = forward_backward(parallel_model, input_ids, labels)
    optimizer.step()
    optimizer.zero_grad()
    return loss
