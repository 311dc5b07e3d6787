"""The multi-rank trainer's command channel: rank 0 tells the other ranks what to do next.

Owns the one collective by which rank 0 of a trainer's process group hands every other rank
its next command (a step's batch, a checkpoint save/load, the weights gather, or the end),
over ``torch.distributed`` (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import torch.distributed as dist


def broadcast_command(command: dict | None) -> dict | None:
    """Rank 0 sends ``command`` to every rank (the others pass None and get it)."""
    box = [command]
    dist.broadcast_object_list(box, src=0)
    return box[0]
