"""How an algorithm's forward and backward passes run over the micro-batches of one step.

Owns the model side of ``BaseAlgorithm``'s optimizer step: calling the model on each
micro-batch (padded or packed, ``algorithms.micro_batches``), turning its logits into the
per-token values every loss reads (log-probs of the sampled tokens, entropy), back-propagating
each micro-batch's loss and clipping the gradient. The loss math stays in ``BaseAlgorithm``,
which hands the runner a :data:`MicroBatchLoss`: a function of one micro-batch's rows and its
``[b, w]`` log-probs and entropy. :class:`ModelRunner` runs everything on this process; a
parallel trainer gives the algorithm a subclass (``runtime.parallel``: a pipeline schedule,
sequence chunks on context-parallel ranks) and the loss code does not change.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import nullcontext

import torch

from areal_flow.algorithms.losses import token_entropy
from areal_flow.algorithms.micro_batches import MicroBatch
from areal_flow.models.logprobs import logprobs_from_logits, model_logits
from areal_flow.models.packed_attention import packed_attention

MicroBatchLoss = Callable[[MicroBatch, torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss(mb, logprobs [b, w], entropy [b, w]) -> 0-dim loss`` of micro-batch ``mb`` (its share of
the step loss, already divided by the step's global normaliser), in ``mb``'s padded layout."""


ENTROPY_CHUNK_ELEMENTS = 1 << 22
"""Logit elements (4-byte float32 each: 16 MiB) the no-grad entropy metric works on at once."""


def entropy_rows_per_chunk(seq: int, vocab: int) -> int:
    """Rows of ``[seq, vocab]`` logits the no-grad entropy metric takes at once: as many as fit in
    ``ENTROPY_CHUNK_ELEMENTS`` (at least 1), so a small vocabulary runs in one vectorised call
    (the tiny models: a whole step batch) and a large one (SmolLM2's 49,152) one row at a time."""
    return max(1, ENTROPY_CHUNK_ELEMENTS // max(1, seq * vocab))


def token_entropy_from_logits(logits: torch.Tensor, temperature: float, *, with_grad: bool) -> torch.Tensor:
    """``[batch, seq]`` entropy (nats) of the distribution that predicted token ``t`` from
    ``logits [batch, seq, vocab]`` (position 0 holds 0). Without grad (a metric only) it runs
    :func:`entropy_rows_per_chunk` rows at a time, so the float32 softmax never holds more than
    ``max([seq, vocab], ENTROPY_CHUNK_ELEMENTS)`` elements; every row's value is the same
    whatever the chunking (each is reduced over its own vocabulary only)."""
    if with_grad:
        return torch.nn.functional.pad(token_entropy(logits[:, :-1] / temperature), (1, 0))
    with torch.no_grad():
        step = entropy_rows_per_chunk(max(logits.shape[1] - 1, 1), logits.shape[-1])
        chunks = [token_entropy(logits[i:i + step, :-1].detach() / temperature)
                  for i in range(0, logits.shape[0], step)]
        return torch.nn.functional.pad(torch.cat(chunks), (1, 0))


def token_outputs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, *,
                  entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probs, entropy)``, both ``[batch, seq]`` float32, of ``logits [batch, seq, vocab]``
    on ``input_ids [batch, seq]`` (``token_logprobs``' layout); the entropy carries a gradient only
    when ``entropy_grad`` (an entropy bonus in the loss)."""
    return (logprobs_from_logits(logits, input_ids, temperature),
            token_entropy_from_logits(logits, temperature, with_grad=entropy_grad))


def head_skip(scored_from: int, width: int) -> int:
    """Leading columns of a ``width``-column row whose logits no loss needs when ``scored_from``
    is the first column whose log-prob or entropy any loss reads: ``scored_from - 1`` (position
    ``t`` predicts token ``t + 1``), at most ``width - 1`` (the head runs on one column at least),
    0 for ``scored_from <= 1``. The LM head then runs on columns ``head_skip`` to ``width - 1``
    alone (``transformers``' ``logits_to_keep = width - head_skip``); the one rule every runner's
    passes (training and no-grad log-probs) keep by."""
    return max(0, min(scored_from - 1, width - 1))


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward takes ``logits_to_keep`` (``transformers``' causal LMs do);
    another model computes every position and gets :func:`head_skip` 0."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def kept_token_outputs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, skip: int, *,
                       entropy_grad: bool | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log-probs, entropy)``, both ``[batch, seq]`` float32 (:func:`token_outputs`' layout), of
    ``input_ids [batch, seq]`` from ``logits [batch, seq - skip, vocab]``: those of columns ``skip``
    on alone (:func:`head_skip`); columns ``0..skip`` hold 0. ``entropy_grad`` as
    :func:`token_outputs`; None: the log-probs alone (the entropy is None, never computed)."""
    ids = input_ids[:, skip:]
    if entropy_grad is None:
        values = (logprobs_from_logits(logits, ids, temperature), None)
    else:
        values = token_outputs(logits, ids, temperature, entropy_grad=entropy_grad)
    return tuple(None if t is None else torch.nn.functional.pad(t, (skip, 0)) for t in values)


class ModelRunner:
    """Forward and backward passes of ``model`` on this process, one micro-batch at a time.

    Args:
        model: a ``transformers`` causal LM (``model(input_ids=, ...).logits``).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._keeps = takes_logits_to_keep(model)

    def _outputs(self, mb: MicroBatch, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
                 scored_from: int, entropy_grad: bool | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(log-probs, entropy)`` ``[b, w]`` of micro-batch ``mb`` of the step batch (``input_ids``,
        ``attention_mask`` ``[B, T]``), as :func:`kept_token_outputs`; a padded micro-batch runs the
        LM head from column :func:`head_skip` on, a packed one (:meth:`_packed_outputs`) on the
        positions that predict a scored token alone. Runs inside the caller's attention context."""
        if mb.packed:
            return self._packed_outputs(mb, input_ids, attention_mask, temperature, scored_from, entropy_grad)
        inputs = mb.model_inputs(input_ids, attention_mask)
        skip = head_skip(scored_from, mb.width) if self._keeps else 0
        logits = model_logits(self.model, **inputs, logits_to_keep=mb.width - skip if skip else 0)
        return kept_token_outputs(logits, inputs["input_ids"], temperature, skip, entropy_grad=entropy_grad)

    def _packed_outputs(self, mb: MicroBatch, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        temperature: float, scored_from: int,
                        entropy_grad: bool | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`_outputs` of a packed micro-batch. Token ``(row, c)`` is predicted by the
        packed position of token ``(row, c - 1)`` (``MicroBatch.token_index``): for a branch's
        first own token that is its root's position, shared by the root's other branches. The LM
        head runs on those positions alone (each once; ``transformers``' ``logits_to_keep`` as an
        index tensor), for columns ``max(scored_from, 1)`` on; other columns hold 0."""
        inputs = mb.model_inputs(input_ids, attention_mask)
        device = input_ids.device
        index, real = mb.token_index(device)
        pred = torch.nn.functional.pad(index[:, :-1], (1, 0))  # [b, w]: position predicting each token
        cols = torch.arange(mb.width, device=device)
        scored = real & (cols >= max(scored_from, 1))
        if self._keeps:
            keep = torch.unique(pred[scored]) if bool(scored.any()) else pred.new_zeros(1)
            logits = model_logits(self.model, **inputs, logits_to_keep=keep)[0]
            at = torch.searchsorted(keep, pred).clamp(max=len(keep) - 1)  # [b, w] row of logits
        else:
            logits, at = model_logits(self.model, **inputs)[0], pred
        z = logits.float() / temperature  # [K, V]
        targets = mb.take(input_ids)
        logp = torch.where(scored, z[at, targets] - torch.logsumexp(z, dim=-1)[at], 0.0)
        if entropy_grad is None:
            return logp, None
        if entropy_grad:
            per_row = token_entropy(z)
        else:
            with torch.no_grad():
                step = entropy_rows_per_chunk(1, z.shape[-1])
                per_row = torch.cat([token_entropy(z[i:i + step].detach()) for i in range(0, len(z), step)])
        return logp, torch.where(scored, per_row[at], 0.0)

    def logprobs(self, micro_batches: list[MicroBatch], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 temperature: float, scored_from: int = 0) -> torch.Tensor:
        """No-grad log-probs ``[B, T]`` float32 of the step batch ``input_ids [B, T]``.
        ``scored_from`` as :meth:`forward_backward`: a padded micro-batch runs the LM head only from
        column ``scored_from - 1`` on and holds 0 up to it; the columns from ``scored_from`` on hold
        the whole row's values."""
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        with torch.no_grad():
            for mb in micro_batches:
                with packed_attention(self.model, mb.attention_groups()) if mb.packed else nullcontext():
                    logp, _ = self._outputs(mb, input_ids, attention_mask, temperature, scored_from, None)
                mb.put(out, logp)
        return out

    def forward_backward(self, micro_batches: list[MicroBatch], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         loss_fn: MicroBatchLoss, *, temperature: float, entropy_grad: bool,
                         scored_from: int = 0) -> None:
        """Accumulate the gradient of ``sum(loss_fn(mb, ...))`` over ``micro_batches`` (backward
        after each one, inside its attention context: activation checkpointing recomputes there).

        ``scored_from``: the first column whose log-prob or entropy any loss reads (the step's
        first response token). A padded micro-batch then computes the LM head only from column
        ``scored_from - 1`` on (:func:`head_skip`, ``transformers``' ``logits_to_keep``: the
        prompt's logits are never needed, and with a large vocabulary they are most of the head's
        work, as TRL scores only completion positions); the columns before hold log-prob and
        entropy 0. The values of the columns kept are those of the whole row's logits."""
        for mb in micro_batches:
            with packed_attention(self.model, mb.attention_groups()) if mb.packed else nullcontext():
                logp, entropy = self._outputs(mb, input_ids, attention_mask, temperature, scored_from, entropy_grad)
                loss_fn(mb, logp, entropy).backward()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the gradient of every parameter to global L2 norm ``max_norm``; returns the
        norm before clipping (``torch.nn.utils.clip_grad_norm_``)."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
