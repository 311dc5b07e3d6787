"""Micro-batches of one optimizer step: which rows of the step go together, in which layout.

Owns how ``BaseAlgorithm`` splits a step's right-padded ``[B, T]`` batch for the forward and
backward passes, in one of two token layouts:

* padded: a micro-batch is rows ``[b, w]`` of the batch, ``w`` = its longest row (columns
  after it are dropped); the model sees the 2-D ``attention_mask``.
* packed: the micro-batch's sequences are concatenated, without their padding, into one row
  ``[1, L]`` (``L`` = the sum of their lengths) with ``position_ids`` restarting at 0 at each
  sequence and no ``attention_mask``; ``BaseAlgorithm`` runs such a row under
  ``areal_flow.models.packed_attention`` (causal attention inside each sequence, one SDPA
  call per group), so attention never crosses a sequence boundary. With ``input_ids`` given
  (``train.shared_prefix``), rows that begin alike run their common prefix once
  (``MicroBatch.shared``, ``areal_flow.algorithms.shared_prefix``: a GRPO group's prompt
  runs once, not ``n`` times). Only the model's forward runs packed: the runner maps each
  token back to the position predicting it (:meth:`MicroBatch.token_index`), so every loss and
  aggregation mode sees the padded layout ``[b, w]`` either way.

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

from areal_flow.algorithms.shared_prefix import share_prefixes, shared_clusters
from areal_flow.models.packed_attention import PackedGroup


@dataclass(frozen=True)
class MicroBatch:
    """Rows of the step batch that run in one forward/backward pass.

    Attributes:
        rows: indices into the step batch's rows.
        lengths: tokens of each row: its last attended column + 1 (the row's prompt +
            response for the right-padded layout of ``areal_flow.batching.collate``).
        packed: the packed layout (one row ``[1, sum(lengths) - sum(shared)]``) instead of ``[b, w]``.
        shared: packed only, one per row: leading tokens the row takes from its *root*, the
            last row before it that shares none (``areal_flow.algorithms.shared_prefix``): the
            packed row holds only the row's tokens after them, at positions ``shared..n-1``,
            attending to the root's first ``shared`` tokens. ``()``: none shared.

    Raises:
        ValueError: ``shared`` given unpacked, of another length than ``rows``, on the first row,
            or not within ``[0, length - 1]`` and the root's length (names the row).
    """

    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    packed: bool
    shared: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.shared:
            return
        if not self.packed or len(self.shared) != len(self.rows) or self.shared[0] != 0:
            raise ValueError(f"MicroBatch.shared={self.shared}: needs the packed layout, one value per row "
                             f"({len(self.rows)}) and 0 on the first row (a root)")
        root = 0
        for i, (q, n) in enumerate(zip(self.shared, self.lengths)):
            if q == 0:
                root = n
            elif not 0 < q < n or q > root:
                raise ValueError(f"MicroBatch.shared: row {self.rows[i]} ({n} tokens) shares {q} tokens with a "
                                 f"root of {root}: must be below its own length and at most the root's")

    @property
    def width(self) -> int:
        """Columns of the padded layout: the longest row, tokens (at least 1)."""
        return max(max(self.lengths, default=0), 1)

    @property
    def tokens(self) -> int:
        """Token positions the model computes: ``sum(lengths) - sum(shared)`` packed, ``rows x
        width`` padded."""
        return sum(self.lengths) - sum(self.shared) if self.packed else len(self.rows) * self.width

    def _shared(self) -> tuple[int, ...]:
        return self.shared or (0,) * len(self.rows)

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

    def segments(self) -> list[tuple[int, int, int]]:
        """Packed only: ``(start, root_start, shared)`` of each row: where its own tokens start in
        the packed row, where its root's start, and how many it takes from the root."""
        out, start, root = [], 0, 0
        for n, q in zip(self.lengths, self._shared()):
            if q == 0:
                root = start
            out.append((start, root, q))
            start += n - q
        return out

    def token_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed only: ``(index, real)``, both ``[b, w]``: the packed-row position holding token
        ``(row, column)`` (the root's for a shared column; 0 after the row's length) and whether
        the column is one of the row's tokens."""
        seg = torch.tensor(self.segments(), dtype=torch.long, device=device).view(-1, 3)
        start, root, q = seg[:, :1], seg[:, 1:2], seg[:, 2:]
        cols = torch.arange(self.width, device=device)
        real = cols < torch.tensor(self.lengths, device=device).unsqueeze(1)
        index = torch.where(cols < q, root + cols, start + cols - q)
        return torch.where(real, index, 0), real

    def model_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        """``input_ids``, ``attention_mask`` and ``position_ids`` for ``token_logprobs``.

        Padded: the rows' ``[b, w]`` ids and mask; ``position_ids`` None (derived from the
        mask). Packed: ``[1, L]`` ids, ``attention_mask`` None and ``position_ids [1, L]`` =
        ``q..n-1`` for each sequence of ``n`` tokens sharing ``q`` (0 unshared), in order.
        """
        if not self.packed:
            return {"input_ids": self.take(input_ids), "attention_mask": self.take(attention_mask),
                    "position_ids": None}
        device = input_ids.device
        spans = list(zip(self.rows, self._shared(), self.lengths))
        ids = torch.cat([input_ids[r, q:n] for r, q, n in spans]).unsqueeze(0)
        positions = torch.cat([torch.arange(q, n, device=device) for _, q, n in spans]).unsqueeze(0)
        return {"input_ids": ids, "attention_mask": None, "position_ids": positions}

    def attention_groups(self) -> tuple[PackedGroup, ...]:
        """Packed only: the packed row's attention structure (``packed_attention``): one group per
        root, holding the root and its branches."""
        groups: list[PackedGroup] = []
        for (start, root, q), n in zip(self.segments(), self.lengths):
            if q == 0:
                groups.append(PackedGroup(start, start + n, ()))
            else:
                g = groups[-1]
                groups[-1] = PackedGroup(g.start, start + n - q, g.branches + ((start - g.start, q),))
        return tuple(groups)

    def split(self, at: int) -> tuple["MicroBatch", "MicroBatch"]:
        """Rows ``[:at]`` and ``[at:]`` as two micro-batches; the second's leading branches lose
        their root to the first, so they become roots (share nothing) themselves."""
        first = MicroBatch(self.rows[:at], self.lengths[:at], self.packed, self.shared[:at])
        # Rows are in token order (shared_prefix), so every later branch shares at least as many
        # tokens with the new root as it did with its old one, and no more than the new root has.
        rest = (0, *self.shared[at + 1:]) if self.shared[at:] else ()
        return first, MicroBatch(self.rows[at:], self.lengths[at:], self.packed, rest)


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
                       pack: bool = False, input_ids: torch.Tensor | None = None) -> list[MicroBatch]:
    """Split a step's rows into micro-batches.

    Args:
        attention_mask: ``[B, T]`` of the step batch (right-padded when ``pack``).
        micro_batch_size: rows per micro-batch when ``max_tokens`` is 0 (batch order).
        max_tokens: token budget of one micro-batch (``train.max_tokens_per_micro_batch``);
            0 = fixed ``micro_batch_size`` rows instead.
        pack: the packed layout (see the module doc).
        input_ids: ``[B, T]``, with ``pack``: rows of a micro-batch that begin with the same
            tokens run them once (``MicroBatch.shared``, ``areal_flow.algorithms.shared_prefix``;
            ``train.shared_prefix``); the rows are reordered inside their micro-batch for it.
            With a token budget, rows that share go into one micro-batch (a cluster cut where it
            would exceed the budget) and the budget counts the tokens computed.

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
    ids = input_ids if pack else None  # shared prefixes: packed rows only
    if max_tokens == 0:
        bins = [rows[i : i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]
        return [_micro_batch(b, lengths, pack, ids) for b in bins]
    too_long = [r for r in rows if lengths[r] > max_tokens]
    if too_long:
        r = too_long[0]
        raise ValueError(f"row {r} has {lengths[r]} tokens, more than train.max_tokens_per_micro_batch="
                         f"{max_tokens}; raise the budget to at least the longest prompt + response")
    if ids is not None:
        return _shared_bins(lengths, ids, max_tokens)
    bins: list[list[int]] = []  # first-fit decreasing: each bin's first row is its longest
    for r in sorted(rows, key=lambda i: -lengths[i]):
        for b in bins:
            cost = sum(lengths[i] for i in b) + lengths[r] if pack else (len(b) + 1) * max(lengths[b[0]], 1)
            if cost <= max_tokens:
                b.append(r)
                break
        else:
            bins.append([r])
    return [_micro_batch(b, lengths, pack, None) for b in bins]


def _shared_bins(lengths: list[int], input_ids: torch.Tensor, max_tokens: int) -> list[MicroBatch]:
    """Packed micro-batches within ``max_tokens`` whose rows share prefixes: the step's rows in
    clusters sharing a prefix (cut to fit the budget, ``shared_prefix.shared_clusters``), put
    first-fit, largest first, into micro-batches by the tokens they compute."""
    pieces = shared_clusters([input_ids[r, :n].tolist() for r, n in enumerate(lengths)], max_tokens)
    cost = [sum(lengths[r] - q for r, q in p) for p in pieces]
    bins: list[list[tuple[int, int]]] = []
    loads: list[int] = []
    for i in sorted(range(len(pieces)), key=lambda i: -cost[i]):
        b = next((b for b, load in enumerate(loads) if load + cost[i] <= max_tokens), None)
        if b is None:
            bins.append([])
            loads.append(0)
            b = len(bins) - 1
        bins[b] += pieces[i]
        loads[b] += cost[i]
    return [MicroBatch(tuple(r for r, _ in b), tuple(lengths[r] for r, _ in b), True,
                       tuple(q for _, q in b) if any(q for _, q in b) else ()) for b in bins]


def _micro_batch(rows: list[int], lengths: list[int], pack: bool, input_ids: torch.Tensor | None) -> MicroBatch:
    """The micro-batch of ``rows``; given ``input_ids``, its rows reordered and sharing their
    common prefixes (:func:`~areal_flow.algorithms.shared_prefix.share_prefixes`)."""
    if input_ids is None:
        return MicroBatch(tuple(rows), tuple(lengths[r] for r in rows), pack)
    order, shared = share_prefixes([input_ids[r, : lengths[r]].tolist() for r in rows])
    rows = [rows[i] for i in order]
    return MicroBatch(tuple(rows), tuple(lengths[r] for r in rows), pack, tuple(shared) if any(shared) else ())


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
        out[i : i + 1] = list(mb.split(half))
    return out
