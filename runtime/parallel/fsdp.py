"""Data parallelism with FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded.

ZeRO-3 (Rajbhandari et al. 2020, sec. 5): each of the ``dp * cp`` ranks keeps
``1 / (dp * cp)`` of every parameter, its gradient and therefore its AdamW
moments (the optimizer is built on the sharded parameters); a layer's
parameters are all-gathered just before its forward and backward and its
gradients reduce-scattered after backward. Each decoder layer is one unit, the
root holds the embedding, final norm and LM head.

Gradients are *summed* over the ranks, not averaged: the loss is already
divided by the global token count of the optimizer step (``loss.TokenMeanLoss``),
so an average would divide a second time by ``dp * cp``. Reductions are forced to
plain ``SUM`` (gloo lacks NCCL's pre-multiplied sum; with a factor of 1 there is
nothing to pre-multiply anyway).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from runtime.parallel.model_parts import held_layers


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, ignored_params: set[nn.Parameter] | None = None,
               layers: list[nn.Module] | None = None) -> None:
    """Shard ``model`` over the 1-D ``dp_mesh`` (the flattened ``dp_cp`` mesh), in place.

    Apply after tensor parallelism (parameters may already be TP ``DTensor``s
    on a sibling mesh dimension) and after activation checkpointing.

    Args:
        model: a ``*ForCausalLM`` or a pipeline stage of one.
        dp_mesh: the ranks that hold different tokens.
        ignored_params: parameters FSDP must leave alone (experts sharded by EP).
        layers: the units sharded one by one (default ``held_layers(model)``, the decoder
            layers of a causal LM; a value model passes its backbone's).
    """
    ignored = ignored_params or set()
    for layer in held_layers(model) if layers is None else layers:
        fully_shard(layer, mesh=dp_mesh, ignored_params=ignored)
    fully_shard(model, mesh=dp_mesh, ignored_params=ignored)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
