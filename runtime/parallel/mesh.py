"""Device mesh of one node's workers, with dimensions from a ``ParallelStrategy``.

The mesh is ``[pp, dp, cp, tp]`` (named ``"pp", "dp", "cp", "tp"``), TP
innermost so that its per-layer collectives use neighbouring devices. Two
flattened sub-meshes are added:

- ``"dp_cp"`` (size ``dp * cp``): the ranks that hold different tokens of the
  batch, over which FSDP shards parameters and reduces gradients, and over
  which the global token count of the loss is summed;
- ``"ep"`` (size ``ep``) and ``"edp"`` (size ``dp * cp / ep``): the ``dp_cp``
  ranks split into expert-parallel groups (EP re-uses the DP x CP ranks, see
  ``compiler.strategy``); experts are sharded over ``"ep"`` and their gradients
  summed over ``"edp"``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from compiler.strategy import ParallelStrategy

MESH_DIMS = ("pp", "dp", "cp", "tp")


def build_device_mesh(strategy: ParallelStrategy, device_type: str) -> DeviceMesh:
    """Build the ``[pp, dp, cp, tp]`` mesh over the current process group.

    Must be called on every rank (it creates process groups). Sub-meshes:
    ``mesh["tp"]``, ``mesh["pp"]``, ``mesh["cp"]``, ``mesh["dp"]``,
    ``dp_cp_mesh(mesh)`` and ``expert_mesh(mesh, strategy)``.

    Args:
        strategy: the node's degrees; ``strategy.world_size`` must equal the
            number of initialised processes.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).

    Raises:
        ValueError: the world size of the process group differs from the strategy's.
    """
    if dist.get_world_size() != strategy.world_size:
        raise ValueError(
            f"strategy {strategy.short()} needs {strategy.world_size} processes, the process group has "
            f"{dist.get_world_size()}"
        )
    mesh = init_device_mesh(
        device_type, (strategy.pp, strategy.dp, strategy.cp, strategy.tp), mesh_dim_names=MESH_DIMS
    )
    dp_cp_mesh(mesh)
    return mesh


def dp_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened ``"dp_cp"`` 1-D mesh (created once, then returned from the mesh's cache)."""
    return mesh["dp", "cp"]._flatten("dp_cp")


def expert_mesh(mesh: DeviceMesh, strategy: ParallelStrategy) -> DeviceMesh:
    """The 2-D ``["edp", "ep"]`` mesh of this rank's ``dp_cp`` group.

    ``ep`` consecutive ``dp_cp`` ranks form one expert-parallel group; the
    ``dp*cp/ep`` groups are each other's data-parallel replicas ("edp").
    Must be called on every rank.
    """
    return dp_cp_mesh(mesh)._unflatten(0, (strategy.dp * strategy.cp // strategy.ep, strategy.ep), ("edp", "ep"))
