"""Decoder layers a rank holds, and the placeholder for layers it does not.

A pipeline stage keeps the ``*ForCausalLM`` object and its parameter names
(``model.layers.3.mlp...``) but replaces the layers of other stages with
:class:`SkippedLayer`, so TP, activation checkpointing and FSDP act on
:func:`held_layers` only.
"""

from __future__ import annotations

import torch
from torch import nn


class SkippedLayer(nn.Module):
    """A decoder layer that lives on another pipeline stage: returns its input unchanged."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


def held_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of ``model.model.layers`` that this rank computes."""
    return [layer for layer in model.model.layers if not isinstance(layer, SkippedLayer)]
