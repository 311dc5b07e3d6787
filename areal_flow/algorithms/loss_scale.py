"""Dynamic loss scaling for fp16 training: the loss is multiplied by a scale before backward so
that small gradients do not flush to zero in fp16, and the gradients are divided by it before
clipping and the optimizer step.

Owns when a step scales (only under fp16 autocast: ``model.dtype=float16``; bf16 has fp32's
exponent range and needs none) and the scale's rule; ``BaseAlgorithm.update_parameters`` calls
it around its backward passes. Must not decide whether the optimizer steps (the algorithm
skips a step whose unscaled gradient norm is not finite, as without scaling).

Rule (Micikevicius et al. 2018, "Mixed Precision Training", sec. 3.3, dynamic variant): start
at ``2**16``; a step whose scaled gradients overflow (inf/NaN) is skipped and halves the scale;
after 2,000 steps in a row without overflow the scale doubles. ``torch.amp.GradScaler``
implements it (its defaults are these numbers: torch.amp documentation, "Gradient Scaling"),
on CPU as on CUDA.

On several ranks (``torch.distributed`` initialised with more than one process: the ranks of a
multi-rank train_step) an overflow on any rank counts on every rank: ``ShardedGradScaler``
(``torch.distributed.fsdp.sharded_grad_scaler``) all-reduces the inf/NaN flag in ``unscale_``.
Each rank holds only its shard of the gradient (FSDP) or of the layers (pipeline stages), so
without it an inf confined to one shard would halve one rank's scale only, and the next step
would reduce gradients scaled differently. Every rank must then call :meth:`unscale` at the same
point (a collective), as every rank's step does. The scale starts initialised, so a pipeline
stage that never computes the loss (before the last) can still unscale its scaled gradients.

The scale and its count of clean steps are checkpointed (:meth:`LossScaler.state_dict`,
``runtime.step_checkpoint``; on several ranks rank 0's, the same on every rank), so a resume
continues with the scale an uninterrupted run has.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def fp16_autocast(device_type: str) -> bool:
    """True when the caller runs under ``torch.autocast(device_type, dtype=torch.float16)``."""
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.float16


class LossScaler:
    """One trainer's dynamic loss scale (module doc), created at its first fp16 step.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``, where the gradients live (on CUDA the current device).
    """

    def __init__(self, device_type: str) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._scaler: torch.amp.GradScaler = ShardedGradScaler(device_type)  # overflow flags all-reduced
        else:
            self._scaler = torch.amp.GradScaler(device_type)
        self._scaler.scale(torch.zeros((), device=device_type))  # creates the scale tensor (module doc)

    @property
    def scale(self) -> float:
        """The current scale (a power of 2)."""
        return float(self._scaler.get_scale())

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``: what to back-propagate (0-dim)."""
        return self._scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the scale, in place (before
        clipping), noting whether any is inf/NaN."""
        self._scaler.unscale_(optimizer)

    def update(self) -> None:
        """After the step: halve the scale if this step's gradients overflowed, else count it
        (and double the scale after 2,000 such steps in a row)."""
        self._scaler.update()

    def state_dict(self) -> dict:
        """The scale and the clean steps counted toward its next doubling (``GradScaler.state_dict``:
        ``scale``, ``_growth_tracker`` and the constant factors), for a checkpoint."""
        return self._scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (before this scaler's first step).

        Raises:
            RuntimeError: ``state`` lacks ``_growth_tracker`` (``GradScaler.load_state_dict``)."""
        self._scaler.load_state_dict(state)
