"""Tensor parallelism (Megatron column/row split) of Llama/Qwen2-family decoders with DTensor.

Megatron-LM (Shoeybi et al. 2019, sec. 3): in each block the first linear of
a pair is split by output features (column-wise: ``q/k/v_proj``,
``gate/up_proj``), the second by input features (row-wise: ``o_proj``,
``down_proj``), so a block needs one all-reduce forward and one backward.
The embedding is split by vocabulary rows and its partial outputs all-reduced;
the LM head is split by vocabulary (output) and its logits all-gathered, so the
loss sees replicated ``[batch, seq, vocab]`` logits.

Attention with local heads: ``transformers`` 5 attention reshapes projections
with ``view(batch, seq, -1, head_dim)`` and merges them back with
``reshape(batch, seq, -1)``, so a rank holding ``n_heads / tp`` query heads and
``n_kv_heads / tp`` KV heads runs unchanged; ``num_key_value_groups`` (the
ratio of the two) is the same on every rank. A Qwen3 attention's per-head ``q_norm`` /
``k_norm`` see this rank's heads only (:func:`head_norm_plan`). Mixture-of-Experts blocks have
no ``gate_proj``; their experts are left whole on every TP rank (or to expert parallelism).

:data:`PARAM_SHARD_DIMS` states, per parameter, the dimension the plans above
shard (what ``reshard_for_tp`` needs to cut a full tensor the same way).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from runtime.parallel.expert_parallel import moe_blocks
from runtime.parallel.model_parts import held_layers

# Parameter FQN pattern (fnmatch) -> tensor dimension split across TP ranks
# (torch.chunk order); parameters that match nothing are replicated.
PARAM_SHARD_DIMS: dict[str, int] = {
    "model.embed_tokens.weight": 0,
    "model.layers.*.self_attn.q_proj.weight": 0,
    "model.layers.*.self_attn.q_proj.bias": 0,
    "model.layers.*.self_attn.k_proj.weight": 0,
    "model.layers.*.self_attn.k_proj.bias": 0,
    "model.layers.*.self_attn.v_proj.weight": 0,
    "model.layers.*.self_attn.v_proj.bias": 0,
    "model.layers.*.self_attn.o_proj.weight": 1,
    "model.layers.*.mlp.gate_proj.weight": 0,
    "model.layers.*.mlp.up_proj.weight": 0,
    "model.layers.*.mlp.down_proj.weight": 1,
    "lm_head.weight": 0,
}


def shard_dim(param_name: str, plan: dict[str, int] = PARAM_SHARD_DIMS) -> int | None:
    """The TP shard dimension of ``param_name`` under ``plan``, ``None`` if replicated."""
    for pattern, dim in plan.items():
        if fnmatchcase(param_name, pattern):
            return dim
    return None


def outer_plan() -> dict[str, ParallelStyle]:
    """Styles of the modules outside the decoder layers (FQNs of a ``*ForCausalLM``)."""
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def attention_plan() -> dict[str, ParallelStyle]:
    """Styles inside one decoder layer's attention."""
    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
    }


def head_norm_plan() -> dict[str, ParallelStyle]:
    """Styles of a Qwen3 attention's per-head RMSNorms (``q_norm``, ``k_norm``): their inputs
    ``[batch, seq, heads / tp, head_dim]`` hold this rank's heads, so they are marked sharded
    on the heads dimension and the ``[head_dim]`` weight replicated; its gradient, a sum over
    every head, is then summed over the TP ranks (each rank's heads contribute their part)."""
    return {f"self_attn.{name}": SequenceParallel(sequence_dim=2, use_local_output=True)
            for name in ("q_norm", "k_norm")}


def dense_mlp_plan() -> dict[str, ParallelStyle]:
    """Styles inside one decoder layer's dense (SwiGLU) MLP."""
    return {
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard ``model``'s linears and embedding in place over ``tp_mesh``.

    ``model`` is a ``*ForCausalLM`` or a pipeline stage with the same FQNs
    (``model.embed_tokens``, ``model.layers``, ``lm_head``); modules a stage
    does not hold (``None``, ``nn.Identity``, ``SkippedLayer``) are skipped. After this, the
    split parameters are ``DTensor``s; module inputs and outputs stay plain
    local tensors. A tied embedding / LM head stays tied: both styles shard the
    shared ``[vocab, hidden]`` weight by vocabulary rows (``Shard(0)``), so the
    two uses share one ``DTensor`` whose gradient sums both contributions.

    Raises:
        ValueError: ``tp_mesh`` is not 1-D.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tensor parallelism needs a 1-D mesh, got {tp_mesh.ndim}-D {tp_mesh.mesh_dim_names}")
    held = {name for name, module in model.named_modules() if not isinstance(module, nn.Identity)}
    tied = "lm_head" in held and "model.embed_tokens" in held and model.lm_head.weight is model.model.embed_tokens.weight
    parallelize_module(model, tp_mesh, {name: style for name, style in outer_plan().items() if name in held})
    if tied:  # both plans shard the [vocab, hidden] weight along dim 0, so one DTensor serves both again
        model.lm_head.weight = model.model.embed_tokens.weight
    for layer in held_layers(model):
        parallelize_module(layer, tp_mesh, layer_plan(layer))


def layer_plan(layer: nn.Module) -> dict[str, ParallelStyle]:
    """Styles of one decoder layer: its attention, a Qwen3 attention's head norms, a dense MLP."""
    plan = attention_plan()
    if hasattr(layer.self_attn, "q_norm"):
        plan |= head_norm_plan()
    if hasattr(layer.mlp, "gate_proj"):
        plan |= dense_mlp_plan()
    return plan


def apply_tensor_parallel_backbone(backbone: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard a decoder stack without LM head (``AutoModel``: ``embed_tokens``, ``layers``,
    ``norm``; the backbone of a scalar-head model, ``areal_flow.models.scalar_head``) in place
    over ``tp_mesh``, with the styles :func:`apply_tensor_parallel` gives the same modules of a
    causal LM: the embedding by vocabulary rows (partial outputs all-reduced), each layer's
    linears column/row-wise. ``last_hidden_state [batch, seq, hidden]`` is then a plain tensor,
    the same on every TP rank (the last ``down_proj``'s all-reduce), so a head reading it is
    left whole (:func:`replicate_unsharded`, or FSDP over ``dp``).

    Raises:
        ValueError: ``tp_mesh`` is not 1-D.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tensor parallelism needs a 1-D mesh, got {tp_mesh.ndim}-D {tp_mesh.mesh_dim_names}")
    parallelize_module(backbone, tp_mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate())})
    for layer in backbone.layers:
        parallelize_module(layer, tp_mesh, layer_plan(layer))


def replicate_unsharded(model: nn.Module, tp_mesh: DeviceMesh, layers: list[nn.Module] | None = None) -> None:
    """Make the parameters TP leaves whole (the RMSNorm weights) replicated ``DTensor``s, in place.

    Without FSDP over them, a TP model mixes plain and ``DTensor`` parameters, which
    ``torch.nn.utils.clip_grad_norm_`` refuses. Each module holding a plain parameter gets
    it as ``Replicate()`` over ``tp_mesh``, takes plain inputs as replicated ``DTensor``s
    and returns plain local tensors, so its neighbours see no change. Every TP rank holds
    the same replicated activations, so the gradients of these parameters are equal on
    every rank and need no reduction. Call after :func:`apply_tensor_parallel`.

    A MoE layer's routed experts (``moe_blocks``) stay plain tensors, replicated on every TP
    rank: their grouped matmul has no ``DTensor`` rule, and their gradients are equal on every
    rank for the same reason (``grad_norm`` norms plain tensors apart from ``DTensor`` s). A
    module returning several tensors (a MoE router) returns them all local. ``layers``: the
    decoder layers (default ``held_layers(model)`` of a causal LM; a value model passes its
    backbone's).
    """
    def to_dtensor(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def to_local(module: nn.Module, outputs, mesh: DeviceMesh):
        if isinstance(outputs, tuple):
            return tuple(x.to_local() if isinstance(x, DTensor) else x for x in outputs)
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    experts = {id(block.experts) for block in moe_blocks(model, layers)}
    for module in list(model.modules()):
        if id(module) in experts:
            continue
        if any(not isinstance(param, DTensor) for param in module.parameters(recurse=False)):
            distribute_module(module, tp_mesh, input_fn=to_dtensor, output_fn=to_local)
