"""The RL algorithm's passes on context-parallel ranks: sequence chunks, whole-sequence loss.

Under ``cp > 1`` the ranks of one DP coordinate hold the same rows (the DP rank's share of the
step) and each runs the model on one contiguous chunk of ``width / cp`` positions of every row
(Ulysses attention, ``context_parallel``, gives each chunk the whole sequence's causal
attention). From its chunk's logits a rank computes the per-position values every loss reads:
the log-prob of the *next* token (so a chunk's last position needs only the first token of
the next chunk, which every rank has: the whole batch is on every rank) and the entropy.
Then :func:`context_parallel.gather_sequence` assembles whole rows of them and every cp rank
runs the algorithm's loss on the whole rows, exactly as one process would: per-sequence means
(``seq-mean-token-mean``), GSPO's sequence ratio and M2PO's batch-wide mask need whole
sequences, and the loss code stays unaware of chunks. The gather's backward hands each rank
the gradient of its own chunk, so FSDP's sum over the ``dp_cp`` ranks adds each chunk's
gradient once. The loss's normalisers and the metrics count the rows once per DP rank, not
once per cp rank (``parallel_trainer``).

Widths are padded to a multiple of ``cp`` with padding tokens after the real ones (right
padding: causal attention keeps them out of every real token's output).

In both passes (training and no-grad log-probs) the LM head runs only from the step's first
response column on (``scored_from``, as ``ModelRunner``'s passes): a rank keeps the positions of
its chunk from column ``scored_from - 1`` on, and at least its chunk's last one
(``model_runner.head_skip`` of the chunk: a chunk all prompt still runs its head on one
position, so every rank's LM head takes part in the backward alike); the columns before hold 0,
and the chunks keep their shape for the gather.
"""

from __future__ import annotations

import math

import torch

from areal_flow.algorithms.losses import token_entropy
from areal_flow.algorithms.micro_batches import MicroBatch
from areal_flow.algorithms.model_runner import MicroBatchLoss, head_skip
from runtime.parallel.apply import ParallelModel
from runtime.parallel.context_parallel import gather_sequence
from runtime.parallel.rl_runner import ShardedRunner, right_padded


class ContextRunner(ShardedRunner):
    """The algorithm's passes on this rank's sequence chunks of a ``cp > 1`` policy.

    Every cp rank calls each method with the same arguments, in the same order (all-to-alls
    in attention, all-gathers of the per-token values).

    Args:
        parallel: this rank's policy (``parallelize`` with ``cp > 1``: Ulysses attention).
    """

    def __init__(self, parallel: ParallelModel) -> None:
        super().__init__(parallel)
        self.cp = parallel.strategy.cp
        self.cp_rank = parallel.coordinate["cp"]
        self.cp_group = parallel.mesh["cp"].get_group()

    def _outputs(self, mb: MicroBatch, input_ids: torch.Tensor, temperature: float, scored_from: int,
                 entropy_grad: bool | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Whole-row ``(log-probs, entropy)`` ``[b, w]`` of micro-batch ``mb`` of the step batch
        ``input_ids [B, T]`` (``kept_token_outputs``' layout), each rank computing its chunk; the LM
        head only from column ``scored_from - 1`` on (the module docstring; 0 holds before it).
        ``entropy_grad`` as ``kept_token_outputs``: None, the log-probs alone (entropy None)."""
        ids = mb.take(input_ids)
        width = ids.shape[1]
        chunk = math.ceil(width / self.cp)
        padded = torch.nn.functional.pad(ids, (0, chunk * self.cp - width + 1))  # + the target after the last
        start = self.cp_rank * chunk
        skip = head_skip(scored_from - start, chunk) if self._keeps else 0  # this chunk's columns skipped
        keep = {"logits_to_keep": chunk - skip} if skip else {}
        positions = torch.arange(start, start + chunk, device=ids.device).unsqueeze(0)
        logits = self.model(input_ids=padded[:, start : start + chunk], position_ids=positions, use_cache=False,
                            **keep).logits
        z = logits.float() / temperature
        targets = padded[:, start + skip + 1 : start + chunk + 1]  # position p predicts token p + 1
        logp = torch.gather(z, -1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
        if entropy_grad is None:
            entropy = None
        elif entropy_grad:
            entropy = token_entropy(logits / temperature)
        else:
            with torch.no_grad():  # a metric: one row at a time, as ``model_runner``
                entropy = torch.stack([token_entropy(logits[i].detach() / temperature) for i in range(len(mb.rows))])

        def whole_rows(chunk_values: torch.Tensor) -> torch.Tensor:  # token t's value sits at t
            gathered = gather_sequence(torch.nn.functional.pad(chunk_values, (skip, 0)), self.cp_group, self.cp_rank)
            return torch.nn.functional.pad(gathered[:, : width - 1], (1, 0))

        return whole_rows(logp), None if entropy is None else whole_rows(entropy)

    def logprobs(self, micro_batches: list[MicroBatch], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 temperature: float, scored_from: int = 0) -> torch.Tensor:
        """No-grad log-probs ``[B, T]`` float32 (the same on every cp rank); ``scored_from`` as
        :meth:`forward_backward` (0 up to column ``scored_from - 1``; no entropy computed)."""
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        with torch.no_grad():
            for mb in right_padded(self.same_count(micro_batches), attention_mask):
                mb.put(out, self._outputs(mb, input_ids, temperature, scored_from, None)[0])
        return out

    def forward_backward(self, micro_batches: list[MicroBatch], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         loss_fn: MicroBatchLoss, *, temperature: float, entropy_grad: bool,
                         scored_from: int = 0) -> None:
        """The step's gradient, one micro-batch at a time: chunk forward, whole-row loss, backward;
        ``scored_from`` as :meth:`ModelRunner.forward_backward` (the LM head from there on)."""
        for mb in right_padded(self.same_count(micro_batches), attention_mask):
            logp, entropy = self._outputs(mb, input_ids, temperature, scored_from, entropy_grad)
            loss_fn(mb, logp, entropy).backward()
        self.reduce_expert_gradients()
