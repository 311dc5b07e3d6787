"""Activation checkpointing of whole decoder layers.

Each held decoder layer keeps only its input during forward and recomputes its
activations during backward (Chen et al. 2016, "Training Deep Nets with
Sublinear Memory Cost", sec. 3): activation memory per layer drops from all of
its intermediates to one ``[batch, seq, hidden]`` tensor, at the cost of one
more forward per layer. It uses the hook that ``transformers`` decoder layers
(``GradientCheckpointingLayer``) already have, which checkpoints ``forward``
rather than ``__call__`` so that FSDP's module hooks are not replayed, and it
keeps parameter names unchanged (a wrapper module would rename them).
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from runtime.parallel.model_parts import held_layers


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Checkpoint every held decoder layer of ``model`` (non-reentrant ``torch.utils.checkpoint``).

    Raises:
        TypeError: a layer is not a ``transformers`` ``GradientCheckpointingLayer``.
    """
    for index, layer in enumerate(held_layers(model)):
        if not isinstance(layer, GradientCheckpointingLayer):
            raise TypeError(f"decoder layer {index} ({type(layer).__name__}) has no gradient checkpointing hook")
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
