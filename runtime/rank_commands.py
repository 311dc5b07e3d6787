"""The multi-rank trainer's command channel: rank 0 tells the other ranks what to do next.

Owns the one collective by which rank 0 of a trainer's process group hands every other rank
its next command (a step's batch, a checkpoint save/load, the weights gather, or the end),
over ``torch.distributed`` (gloo on CPU, NCCL on GPU), signed
(``runtime.parallel.signed_objects``: no rank unpickles an unauthenticated byte).
"""

from __future__ import annotations

from runtime.parallel import signed_objects


def broadcast_command(command: dict | None) -> dict | None:
    """Rank 0 sends ``command`` to every rank (the others pass None and get it).

    Raises:
        runtime.parallel.signed_objects.TamperedMessage: the command failed its MAC.
    """
    return signed_objects.broadcast(command, src=0, channel="rank_commands")
