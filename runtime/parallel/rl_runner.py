"""The RL algorithm's model runner on one rank of a parallelized policy (DP, TP, EP).

``BaseAlgorithm`` runs its forward and backward passes through a runner
(``areal_flow.algorithms.model_runner``). On a rank of a parallel strategy the passes are the
same module calls (FSDP and TP hide in the module, EP's all-to-alls too); what changes is what
follows the backward: expert gradients are summed over their ``edp`` replicas
(``expert_parallel.reduce_expert_gradients``, which FSDP does not see) and the gradient norm
counts every gradient once over the ranks that hold pieces of it (``grad_norm``). Pipeline and
context parallelism replace the passes themselves (``rl_pipeline``, ``rl_context``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal_flow.algorithms.micro_batches import MicroBatch, split_to_count
from areal_flow.algorithms.model_runner import MicroBatchLoss, ModelRunner
from runtime.parallel.apply import ParallelModel
from runtime.parallel.expert_parallel import reduce_expert_gradients
from runtime.parallel.grad_norm import clip_grad_norm


def right_padded(micro_batches: list[MicroBatch], attention_mask: torch.Tensor) -> list[MicroBatch]:
    """``micro_batches`` in the padded layout (a packed one runs padded, with the same values),
    after checking that every row is right-padded: pipeline stages and Ulysses attention mask
    causally only, which is exact on every real token of a row whose real tokens come first.

    Raises:
        ValueError: a row with padding before its last real token (names the row).
    """
    real = attention_mask.bool().sum(dim=1).tolist()
    for mb in micro_batches:
        for row, length in zip(mb.rows, mb.lengths):
            if real[row] != length:
                raise ValueError(f"row {row} has padding inside its first {length} tokens: pipeline and context "
                                 "parallelism need right-padded rows (real tokens first)")
    return [MicroBatch(mb.rows, mb.lengths, packed=False) for mb in micro_batches]


class ShardedRunner(ModelRunner):
    """:class:`ModelRunner` of ``parallel.module`` on this rank.

    Args:
        parallel: this rank's parallelized policy (``runtime.parallel.apply.parallelize``).
    """

    def __init__(self, parallel: ParallelModel) -> None:
        super().__init__(parallel.module)
        self.parallel = parallel
        self.dp_group = parallel.mesh["dp"].get_group() if parallel.strategy.dp > 1 else None

    def same_count(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        """``micro_batches`` split up to the most any DP rank has (``micro_batches.split_to_count``):
        every DP rank runs as many forward and backward passes (FSDP's and EP's collectives pair
        up) whatever its rows' lengths under a token budget. A collective of the DP group."""
        if self.dp_group is None:
            return micro_batches
        count = torch.tensor([len(micro_batches)], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.dp_group)
        return split_to_count(micro_batches, int(count))

    def logprobs(self, micro_batches: list[MicroBatch], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 temperature: float, scored_from: int = 0) -> torch.Tensor:
        """:meth:`ModelRunner.logprobs` (``[B, T]`` float32) over as many micro-batches as every DP
        rank runs; ``scored_from`` as :meth:`forward_backward` (the LM head from there on)."""
        return super().logprobs(self.same_count(micro_batches), input_ids, attention_mask, temperature, scored_from)

    def forward_backward(self, micro_batches: list[MicroBatch], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         loss_fn: MicroBatchLoss, *, temperature: float, entropy_grad: bool,
                         scored_from: int = 0) -> None:
        """:meth:`ModelRunner.forward_backward` over as many micro-batches as every DP rank runs,
        then the expert gradients summed over their replicas. ``scored_from`` as there: the
        hidden states are sliced before the LM head, so a TP head (split by vocabulary, its
        logits all-gathered) runs on the kept columns alone too; the TP ranks of a DP rank hold
        the same rows, so their slices agree, and FSDP's and EP's collectives come before it."""
        super().forward_backward(self.same_count(micro_batches), input_ids, attention_mask, loss_fn,
                                 temperature=temperature, entropy_grad=entropy_grad, scored_from=scored_from)
        self.reduce_expert_gradients()

    def reduce_expert_gradients(self) -> None:
        """Sum the expert gradients over the ``edp`` replicas (no-op without EP or with one replica)."""
        if self.parallel.edp_mesh is not None:
            reduce_expert_gradients(self.parallel.expert_params, self.parallel.edp_mesh)

    def clip_grad_norm(self, max_norm: float, **where) -> torch.Tensor:
        """Clip to global L2 norm ``max_norm`` over the whole model replica; returns the norm
        before clipping (``grad_norm.clip_grad_norm``: each mesh's ``DTensor`` norms reduced over
        it; with EP the expert blocks summed over the ``ep`` group; ``where``: its ``pp_group``
        and ``counted_elsewhere``)."""
        parallel = self.parallel
        ep_group = parallel.ep_mesh.get_group() if parallel.ep_mesh is not None else None
        return clip_grad_norm(self.model.parameters(), max_norm, experts=parallel.expert_params, ep_group=ep_group,
                              **where)
