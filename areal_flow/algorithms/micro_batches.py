"""Micro-batches of one optimizer step: which rows of the step go together, in which layout.

Owns how ``BaseAlgorithm`` splits a step's right-padded ``[B, T]`` batch for the forward and
backward passes, in one of two token layouts:

* padded: a micro-batch is rows ``[b, w]`` of the batch, ``w`` = its longest row (columns
  after it are dropped); the model sees the 2-D ``attention_mask``.
* packed: the micro-batch's sequences are concatenated, without their padding, into one row
  ``[1, L]`` (``L`` = the sum of their lengths) with ``position_ids`` restarting at 0 at each
  sequence and no ``attention_mask``; ``BaseAlgorithm`` runs such a row under
  ``areal_flow.models.packed_attention`` (causal attention inside each sequence, one SDPA
  call per sequence), so attention never crosses a sequence boundary. A sequence's first
  token then holds the log-prob of following the previous sequence: meaningless, and masked,
  because ``loss_mask[:, 0]`` is 0 (the first token has no log-prob). Only the model's
  forward runs packed: its per-token outputs (log-probs, entropy) are unpacked to ``[b, w]``
  (:meth:`MicroBatch.unpack`) before the losses, so every loss and aggregation mode sees the
  padded layout either way.

and in one of two groupings: ``micro_batch_size`` rows in batch order, or, with a token
budget, rows sorted by length (longest first) and put first-fit into micro-batches whose
computed tokens (padded: rows x width; packed: the sum of lengths) stay within the budget
(dynamic micro-batching, as AReaL's ``max_tokens_per_mb``). Gradients of a step's
micro-batches are summed, so the grouping changes only the summation order. Data-parallel
ranks must run as many micro-batches as each other (their collectives pair up), so a rank
whose budget gives fewer splits some (:func:`split_to_count`) up to the most any rank has, as
verl's dynamic batch size does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    """Rows of the step batch that run in one forward/backward pass.

    Attributes:
        rows: indices into the step batch's rows.
        lengths: tokens of each row: its last attended column + 1 (the row's prompt +
            response for the right-padded layout of ``areal_flow.batching.collate``).
        packed: the packed layout (one row ``[1, sum(lengths)]``) instead of ``[b, w]``.
    """

    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    packed: bool

    @property
    def width(self) -> int:
        """Columns of the padded layout: the longest row, tokens (at least 1)."""
        return max(max(self.lengths, default=0), 1)

    @property
    def tokens(self) -> int:
        """Token positions the model computes: ``sum(lengths)`` packed, ``rows x width`` padded."""
        return sum(self.lengths) if self.packed else len(self.rows) * self.width

    def _row_index(self, device: torch.device) -> slice | torch.Tensor:
        """The rows as a slice (a view) when they are consecutive, else as an index tensor."""
        first = self.rows[0] if self.rows else 0
        if self.rows == tuple(range(first, first + len(self.rows))):
            return slice(first, first + len(self.rows))
        return torch.tensor(self.rows, device=device)

    def take(self, values: torch.Tensor) -> torch.Tensor:
        """This micro-batch's rows of a per-token tensor ``[B, T, ...]``, padded layout
        ``[b, w, ...]`` (the layout the losses and their aggregation run in, both layouts)."""
        return values[self._row_index(values.device), : self.width]

    def put(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values [b, w, ...]`` (the layout of :meth:`take`) back into ``out [B, T, ...]``."""
        out[self._row_index(out.device), : self.width] = values

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """A model output in this micro-batch's layout (``[1, L, ...]`` packed) as ``[b, w, ...]``,
        zero after each row's length; the padded layout is returned as it is."""
        if not self.packed:
            return values
        out = values.new_zeros((len(self.rows), self.width, *values.shape[2:]))
        start = 0
        for i, n in enumerate(self.lengths):
            out[i, :n] = values[0, start : start + n]
            start += n
        return out

    def model_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        """``input_ids``, ``attention_mask`` and ``position_ids`` for ``token_logprobs``.

        Padded: the rows' ``[b, w]`` ids and mask; ``position_ids`` None (derived from the
        mask). Packed: ``[1, L]`` ids, ``attention_mask`` None and ``position_ids [1, L]`` =
        ``0..n-1`` for each sequence of ``n`` tokens, in order.
        """
        if not self.packed:
            return {"input_ids": self.take(input_ids), "attention_mask": self.take(attention_mask),
                    "position_ids": None}
        device = input_ids.device
        ids = torch.cat([input_ids[r, :n] for r, n in zip(self.rows, self.lengths)]).unsqueeze(0)
        positions = torch.cat([torch.arange(n, device=device) for n in self.lengths]).unsqueeze(0)
        return {"input_ids": ids, "attention_mask": None, "position_ids": positions}


def row_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Each row's last attended column + 1 (0 for a row without any), tokens.

    Args:
        attention_mask: ``[B, T]``, 1 on real tokens.
    """
    attended = attention_mask.bool()
    cols = torch.arange(1, attended.shape[1] + 1, device=attended.device)
    return (attended * cols).amax(dim=1).tolist() if attended.shape[1] else [0] * attended.shape[0]


def trimmed_width(attention_mask: torch.Tensor) -> int:
    """Columns up to the last one any row of ``attention_mask [b, T]`` attends to (trailing
    padding is dropped: a causal LM's outputs before it do not change); ``T`` when none is."""
    return max(row_lengths(attention_mask), default=0) or attention_mask.shape[1]


def plan_micro_batches(attention_mask: torch.Tensor, *, micro_batch_size: int, max_tokens: int = 0,
                       pack: bool = False) -> list[MicroBatch]:
    """Split a step's rows into micro-batches.

    Args:
        attention_mask: ``[B, T]`` of the step batch (right-padded when ``pack``).
        micro_batch_size: rows per micro-batch when ``max_tokens`` is 0 (batch order).
        max_tokens: token budget of one micro-batch (``train.max_tokens_per_micro_batch``);
            0 = fixed ``micro_batch_size`` rows instead.
        pack: the packed layout (see the module doc).

    Returns:
        micro-batches covering every row once (none for ``B = 0``).

    Raises:
        ValueError: ``micro_batch_size < 1``, ``max_tokens < 0``, a row longer than
            ``max_tokens`` (naming the row and the key), or ``pack`` with a row whose real
            tokens are not a prefix (left padding or holes cannot be packed).
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size}: must be >= 1")
    if max_tokens < 0:
        raise ValueError(f"train.max_tokens_per_micro_batch={max_tokens}: must be >= 0 (0 = off)")
    lengths = row_lengths(attention_mask)
    if pack:
        real = attention_mask.bool().sum(dim=1).tolist()
        holes = [r for r, (n, k) in enumerate(zip(lengths, real)) if n != k]
        if holes:
            raise ValueError(f"sequence packing needs right-padded rows (real tokens first); row {holes[0]} has "
                             f"padding inside its first {lengths[holes[0]]} tokens")
    rows = list(range(len(lengths)))
    if max_tokens == 0:
        return [MicroBatch(tuple(rows[i : i + micro_batch_size]), tuple(lengths[i : i + micro_batch_size]), pack)
                for i in range(0, len(rows), micro_batch_size)]
    too_long = [r for r in rows if lengths[r] > max_tokens]
    if too_long:
        r = too_long[0]
        raise ValueError(f"row {r} has {lengths[r]} tokens, more than train.max_tokens_per_micro_batch="
                         f"{max_tokens}; raise the budget to at least the longest prompt + response")
    bins: list[list[int]] = []  # first-fit decreasing: each bin's first row is its longest
    for r in sorted(rows, key=lambda i: -lengths[i]):
        for b in bins:
            cost = sum(lengths[i] for i in b) + lengths[r] if pack else (len(b) + 1) * max(lengths[b[0]], 1)
            if cost <= max_tokens:
                b.append(r)
                break
        else:
            bins.append([r])
    return [MicroBatch(tuple(b), tuple(lengths[i] for i in b), pack) for b in bins]


def split_to_count(micro_batches: list[MicroBatch], count: int) -> list[MicroBatch]:
    """``micro_batches`` split until there are ``count`` of them: the one computing the most
    tokens (of those with two rows or more) is cut into its first and second half of rows, in
    place, again and again. A part never computes more tokens than the whole (fewer rows, no
    wider), so a token budget still holds.

    Raises:
        ValueError: ``count`` exceeds the rows (a micro-batch holds at least one).
    """
    rows = sum(len(mb.rows) for mb in micro_batches)
    if count > rows:
        raise ValueError(f"cannot split {rows} rows into {count} micro-batches (each needs a row)")
    out = list(micro_batches)
    while len(out) < count:
        i = max((j for j, mb in enumerate(out) if len(mb.rows) > 1), key=lambda j: out[j].tokens)
        mb, half = out[i], (len(out[i].rows) + 1) // 2
        out[i : i + 1] = [MicroBatch(mb.rows[:half], mb.lengths[:half], mb.packed),
                          MicroBatch(mb.rows[half:], mb.lengths[half:], mb.packed)]
    return out
