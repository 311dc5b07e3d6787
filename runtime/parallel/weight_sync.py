"""Weight sync from a sharded training layout to the generation layout, bucket by bucket.

Training parameters may be FSDP shards, TP ``DTensor``s (or both) and EP
expert blocks. :func:`iter_weight_buckets` rebuilds full tensors one parameter
at a time (a collective every rank of the model replica joins, in the same
order) and groups them into buckets of at most ``bucket_bytes``, so one rank
never holds more than one bucket plus one tensor of gathered weights, not the
whole model. Each bucket carries an xxhash64 checksum of its names, dtypes,
shapes and bytes, which the receiver recomputes after transfer.

When the generation engine runs with its own TP degree, :func:`reshard_for_tp`
cuts each full tensor of a bucket the way ``tensor_parallel`` shards it.

Under pipeline parallelism each stage yields its own parameters only. Buffers
(RoPE frequencies) are not sent: the generation side recomputes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import xxhash
from torch import nn
from torch.distributed.tensor import DTensor

from runtime.parallel.expert_parallel import ShardedExperts, gather_expert_tensor
from runtime.parallel.tensor_parallel import PARAM_SHARD_DIMS, shard_dim


@dataclass
class WeightBucket:
    """Full tensors of some parameters and their checksum.

    Attributes:
        tensors: parameter FQN -> full tensor (the unsharded model's shape and dtype).
        checksum: :func:`bucket_checksum` of ``tensors`` (unsigned 64-bit).
    """

    tensors: dict[str, torch.Tensor]
    checksum: int


def bucket_checksum(tensors: dict[str, torch.Tensor]) -> int:
    """xxhash64 over (name, dtype, shape, raw bytes) of each tensor, in name order."""
    digest = xxhash.xxh64()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.intdigest()


def _full(owner: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """The unsharded value of a parameter (or its gradient) of ``owner`` (collective if sharded)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    if isinstance(owner, ShardedExperts):
        tensor = gather_expert_tensor(tensor, owner.ep_group)
    return tensor.detach()


def _full_nbytes(owner: nn.Module, param: torch.Tensor) -> int:
    scale = owner.ep if isinstance(owner, ShardedExperts) else 1
    return param.numel() * param.element_size() * scale  # a DTensor's numel() is the global one


def full_named_tensors(model: nn.Module, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(FQN, full tensor)`` of every parameter held here (or of its gradient, skipping ``None`` ones).

    A generator of collectives: every rank of the model replica must consume it fully, in step.
    """
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            tensor = param.grad if grads else param
            if tensor is not None:
                yield (f"{module_name}.{param_name}" if module_name else param_name), _full(module, tensor)


def iter_weight_buckets(model: nn.Module, bucket_bytes: int) -> Iterator[WeightBucket]:
    """Full parameters of ``model`` in buckets of at most ``bucket_bytes`` bytes.

    A parameter larger than ``bucket_bytes`` travels alone in its own bucket.
    Every rank of the model replica must iterate to the end (collectives);
    all of them receive the same buckets, and one rank per pipeline stage sends them.

    Args:
        model: ``ParallelModel.module`` (or any module, sharded or not).
        bucket_bytes: bytes of full tensors per bucket (> 0).

    Yields:
        :class:`WeightBucket` s, parameters in ``named_modules`` order.

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive")
    tensors: dict[str, torch.Tensor] = {}
    filled = 0
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            size = _full_nbytes(module, param)
            if tensors and filled + size > bucket_bytes:
                yield WeightBucket(tensors, bucket_checksum(tensors))
                tensors, filled = {}, 0
            tensors[f"{module_name}.{param_name}" if module_name else param_name] = _full(module, param)
            filled += size
    if tensors:
        yield WeightBucket(tensors, bucket_checksum(tensors))


def reshard_for_tp(
    full_state_dict_bucket: dict[str, torch.Tensor], tp_rank: int, tp_size: int, plan: dict[str, int] = PARAM_SHARD_DIMS
) -> dict[str, torch.Tensor]:
    """The shards of a bucket's full tensors that generation TP rank ``tp_rank`` of ``tp_size`` holds.

    Args:
        full_state_dict_bucket: FQN -> full tensor (e.g. ``WeightBucket.tensors``).
        tp_rank, tp_size: the generation engine's TP coordinate and degree.
        plan: FQN pattern -> shard dimension (default: the training TP plan,
            ``tensor_parallel.PARAM_SHARD_DIMS``); unmatched tensors are copied whole.

    Returns:
        FQN -> contiguous shard (``torch.chunk`` order along the plan's dimension).

    Raises:
        ValueError: ``tp_rank`` outside ``[0, tp_size)``, or a sharded dimension
            not divisible by ``tp_size`` (names the parameter).
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
    shards = {}
    for name, tensor in full_state_dict_bucket.items():
        dim = shard_dim(name, plan)
        if dim is None or tp_size == 1:
            shards[name] = tensor.clone()
            continue
        if tensor.shape[dim] % tp_size:
            raise ValueError(f"{name}: dimension {dim} of size {tensor.shape[dim]} is not divisible by tp={tp_size}")
        shards[name] = tensor.chunk(tp_size, dim)[tp_rank].contiguous()
    return shards
