"""Expert parallelism for ``transformers`` MoE layers (Qwen3-MoE, Mixtral, ...) with all-to-all dispatch.

The ``n_experts`` routed experts of each MoE layer are split into ``ep``
contiguous blocks, block ``r`` on rank ``r`` of the ``ep`` group (GShard,
Lepikhin et al. 2020, sec. 2.2). Each rank routes its own tokens with the
(replicated) router, then:

1. sorts its ``tokens x top_k`` assignments by expert, so the rows for rank
   ``r`` are contiguous, and exchanges the per-rank row counts;
2. all-to-all sends each row (the token's hidden state) to the rank owning its
   expert, with the expert's local index;
3. each rank runs its experts on the rows it received (SwiGLU:
   ``down(act(gate(x)) * up(x))``);
4. a second all-to-all returns the outputs to the senders, which weight them by
   the router probabilities and add them per token.

Both all-to-alls are differentiable, so each expert's gradient collects every
token routed to it from the whole ``ep`` group; the ``edp`` replicas of an
expert block (``dp * cp / ep`` of them) then sum their gradients with
:func:`reduce_expert_gradients`. Experts are kept out of FSDP. The router's
auxiliary load-balancing loss is not part of the training loss here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from runtime.parallel.collectives import all_to_all
from runtime.parallel.model_parts import held_layers


class ShardedExperts(nn.Module):
    """This rank's block of a MoE layer's experts; same parameter names as the ``transformers`` module.

    Attributes:
        gate_up_proj: ``[n_experts / ep, 2 * intermediate, hidden]``.
        down_proj: ``[n_experts / ep, hidden, intermediate]``.
    """

    def __init__(self, experts: nn.Module, ep_group: dist.ProcessGroup) -> None:
        super().__init__()
        for flag, wanted in (("is_transposed", False), ("has_bias", False), ("has_gate", True), ("is_concatenated", True)):
            if getattr(experts, flag, wanted) != wanted:
                raise NotImplementedError(f"{type(experts).__name__}: expert parallelism needs {flag}={wanted}")
        self.ep_group = ep_group
        self.ep = dist.get_world_size(ep_group)
        self.num_experts = experts.num_experts
        self.local_experts = self.num_experts // self.ep
        first = dist.get_rank(ep_group) * self.local_experts
        block = slice(first, first + self.local_experts)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[block].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[block].clone())
        self.act_fn = experts.act_fn

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Args: hidden_states ``[tokens, hidden]``; top_k_index, top_k_weights ``[tokens, top_k]``.

        Returns: ``[tokens, hidden]``, the router-weighted sum of the chosen experts' outputs.
        """
        top_k = top_k_index.shape[1]
        expert_of_row = top_k_index.reshape(-1)
        order = torch.argsort(expert_of_row, stable=True)  # assignment rows grouped by expert, hence by rank
        sorted_experts = expert_of_row[order]
        token_of_row = order // top_k
        send_counts = torch.bincount(sorted_experts // self.local_experts, minlength=self.ep)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        send, recv = send_counts.tolist(), recv_counts.tolist()

        local_ids = all_to_all((sorted_experts % self.local_experts).unsqueeze(1), self.ep_group, recv, send)[:, 0]
        rows = all_to_all(hidden_states[token_of_row], self.ep_group, recv, send)  # [received rows, hidden]
        outputs = torch.zeros_like(rows)
        for expert in range(self.local_experts):
            picked = (local_ids == expert).nonzero().squeeze(1)
            gate, up = nn.functional.linear(rows[picked], self.gate_up_proj[expert]).chunk(2, dim=-1)
            outputs = outputs.index_add(0, picked, nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert]))
        returned = all_to_all(outputs, self.ep_group, send, recv)  # [sent rows, hidden], in send order
        weights = top_k_weights.reshape(-1)[order].unsqueeze(1).to(returned.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token_of_row, returned * weights)


def moe_blocks(model: nn.Module, layers: list[nn.Module] | None = None) -> list[nn.Module]:
    """The MoE blocks (``layer.mlp`` with an ``experts`` child) of ``layers`` (default: the
    held layers of the causal LM ``model``; a value model passes its backbone's)."""
    return [layer.mlp for layer in (held_layers(model) if layers is None else layers) if hasattr(layer.mlp, "experts")]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh,
                          layers: list[nn.Module] | None = None) -> list[nn.Parameter]:
    """Replace every held MoE layer's experts with this rank's :class:`ShardedExperts` block
    (``layers``: the decoder layers, default ``held_layers(model)`` of a causal LM; a value
    model passes its backbone's).

    Returns:
        The expert parameters in model order (to keep out of FSDP; the same
        order on every rank, as collectives over them need).

    Raises:
        ValueError: the model has no MoE layer, or ``ep`` does not divide its experts.
    """
    blocks = moe_blocks(model, layers)
    if not blocks:
        raise ValueError(f"expert parallelism over {ep_mesh.size()} ranks: {type(model).__name__} has no MoE layer")
    params: list[nn.Parameter] = []
    for block in blocks:
        if block.experts.num_experts % ep_mesh.size():
            raise ValueError(f"ep={ep_mesh.size()} must divide the number of experts ({block.experts.num_experts})")
        block.experts = ShardedExperts(block.experts, ep_mesh.get_group())
        params += list(block.experts.parameters())
    return params


def reduce_expert_gradients(expert_params: list[nn.Parameter], edp_mesh: DeviceMesh) -> None:
    """Sum expert gradients over the ``edp`` replicas (no-op when there is one replica)."""
    if edp_mesh.size() == 1:
        return
    for param in expert_params:
        if param.grad is not None:
            dist.all_reduce(param.grad, group=edp_mesh.get_group())


def gather_expert_tensor(local: torch.Tensor, ep_group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate the ``ep`` ranks' blocks ``[n_experts / ep, ...]`` into ``[n_experts, ...]`` (collective)."""
    blocks = [torch.empty_like(local) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(blocks, local.contiguous(), group=ep_group)
    return torch.cat(blocks)
