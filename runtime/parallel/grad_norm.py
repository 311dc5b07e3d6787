"""Gradient clipping to a global L2 norm when no rank holds every gradient.

``torch.nn.utils.clip_grad_norm_`` sees the parameters of one module on one rank, and stacks
their norms, so it refuses ``DTensor`` s of different meshes (FSDP over ``dp`` with TP: the
parameters TP leaves whole live on the 1-D ``dp_cp`` mesh, the split ones on ``dp_cp x tp``); each
mesh's norm is taken apart here (``DTensor`` reduces it over its mesh). Nor does one rank hold
the whole model under pipeline parallelism (each stage holds some layers) or expert
parallelism (each rank holds ``n_experts / ep`` experts as plain tensors, outside FSDP). Here
the squared norm is summed by where each gradient lives:

    ||g||^2 = sum over pp stages of ( ||g_dense||^2 + sum over ep ranks of ||g_experts||^2 )

where ``g_dense`` is reduced over its mesh by ``DTensor`` and the expert blocks are equal on
their ``edp`` replicas (``expert_parallel.reduce_expert_gradients``), so each is counted once.
A parameter held twice (a tied embedding's copy on the last pipeline stage) is left out of the
sum and clipped all the same. Clipping multiplies every gradient by
``min(1, max_norm / (||g|| + 1e-6))``, torch's coefficient.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """L2 norm (0-dim fp32, on ``device``) of ``grads``; for ``DTensor`` s their global norm (a
    collective of each mesh). ``DTensor`` s on different meshes (FSDP's 1-D ``dp_cp`` mesh for a
    parameter TP leaves whole, its 2-D ``dp_cp x tp`` mesh for a TP-split one) and plain tensors
    are normed by mesh, then combined: ``||g|| = sqrt(sum over groups ||g_group||^2)``."""
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    squared = torch.zeros((), dtype=torch.float32, device=device)
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members)
        squared = squared + (norm.full_tensor() if isinstance(norm, DTensor) else norm).float().to(device) ** 2
    return squared.sqrt()


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float, *, experts: Iterable[nn.Parameter] = (),
                   ep_group: dist.ProcessGroup | None = None, pp_group: dist.ProcessGroup | None = None,
                   counted_elsewhere: Iterable[nn.Parameter] = ()) -> torch.Tensor:
    """Clip the gradients of ``params`` to global L2 norm ``max_norm``; returns the norm before
    clipping (0-dim fp32, equal on every rank of the model replica). Every rank of the
    replica must call it (collectives over DTensor meshes, ``ep_group`` and ``pp_group``).

    Args:
        params: this rank's parameters (its pipeline stage's), experts included.
        experts: those of ``params`` sharded over ``ep_group`` (expert parallelism).
        ep_group: the expert-parallel group (required with ``experts``).
        pp_group: the pipeline ranks of this rank's ``dp``/``cp``/``tp`` coordinate, or ``None``.
        counted_elsewhere: those of ``params`` whose gradient another stage counts (a tied copy).
    """
    params = [p for p in params if p.grad is not None]
    expert_ids = {id(p) for p in experts}
    skipped = {id(p) for p in counted_elsewhere}
    device = params[0].grad.device if params else torch.device("cpu")
    dense = [p.grad for p in params if id(p) not in expert_ids | skipped]
    sharded = [p.grad for p in params if id(p) in expert_ids and id(p) not in skipped]
    squared = _norm(dense, device) ** 2
    expert_squared = _norm(sharded, device) ** 2
    if ep_group is not None:
        dist.all_reduce(expert_squared, group=ep_group)
    squared = squared + expert_squared
    if pp_group is not None:
        dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    coefficient = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    with torch.no_grad():
        for param in params:
            param.grad.mul_(coefficient)
    return total
