"""The plan of one engine step's prefill: which cache rows compute which tokens, and which copy.

The engine prefills the rows it admits (and, after a weight update, every row again). Rows
often begin alike: a GRPO group's samples repeat one prompt, and chat prompts share their
template's system turn (27 of SmolLM2's 44-46 chat-arithmetic prompt tokens). A token's keys
and values depend only on the tokens before it, so rows that begin alike compute their common
prefix once and the others copy it (``KVDecoder.copy_rows``). :func:`plan_prefill` orders:

1. Identical prompts: one row of each distinct prompt (its *first*) computes it; the group's
   other rows copy it and take its logits.
2. From the cache: a distinct prompt whose beginning a cached row already holds (valid under the
   current weights: a row decoding another sample of the group, or another prompt with the same
   system turn) copies the longest such beginning, at least :data:`MIN_CACHED` tokens or the
   whole prompt but its last token, and computes the rest.
3. Among the distinct prompts of the step: they are cut into clusters by
   :func:`areal_flow.algorithms.shared_prefix.share_prefixes` (the cut that computes the fewest
   tokens; the trainer's shared-prefix forward uses the same); a cluster's root computes its
   prompt (after what it copied from the cache), every other prompt (a *branch*) that shares
   more with its root than with the cache copies ``q`` tokens from the root's row, once the root
   is complete, and computes the rest. Only where these branches skip at least
   :data:`MIN_SKIPPED` tokens more than the cache gives them: their stage is one more forward,
   which reads every weight once more.
4. Rows with tokens of their own (after an update) compute those after their prompt.

vLLM reaches steps 1 and 2 by its prefix cache, in whole blocks (vLLM-CPU's are multiples of 32
tokens, 128 by default), and step 3 where an earlier request cached those blocks.

A copy is kept bit for bit (no later step writes a row's first ``Copy.lengths[i]`` positions), so
decode may read them from the source row while it lives (:func:`prefix_rows`): the rows of a group then read one
copy of their prompt, which stays in the core's caches, as vLLM's rows read one shared block.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch

from areal_flow.algorithms.shared_prefix import common_prefix, share_prefixes

MIN_SKIPPED = 64
"""Fewest prompt tokens the branches of step 3 must skip for their stage to run (tokens).
A heuristic, set from SmolLM2-135M bf16 on one core: a prefilled token costs ~0.6 ms in a batch
of prompts, and a forward of a few rows ~15 ms (it streams the ~270 MB of weights once), so the
break-even is ~25 tokens; 64 leaves room for other models and thread counts."""

MIN_CACHED = 16
"""Fewest tokens a prompt copies from a cached row (step 2) unless it is the whole prompt but its
last token: a shorter common beginning (a BOS token, a chat turn's header) is not worth a copy."""


@dataclass(frozen=True)
class Copy:
    """Copy the first ``lengths[i]`` cached positions of cache row ``src[i]`` into ``dst[i]``.
    Row ``dst[i]`` keeps them, bit for bit, as long as both rows live: no later step writes
    there (the engine's decode attention reads them from ``src[i]``, ``decode_attention``'s
    ``prefix_rows``)."""

    src: list[int]
    dst: list[int]
    lengths: list[int]

    @property
    def length(self) -> int:
        """Positions to copy in one slice for every pair (the longest; what a row gets past its
        own ``lengths[i]`` is overwritten by its forward, or by decode before decode reads it)."""
        return max(self.lengths)


@dataclass(frozen=True)
class Forward:
    """One prefill forward: stale row ``rows[i]`` computes its tokens ``[starts[i], ends[i])``
    after the ``starts[i]`` positions its cache row holds; the logits of its last token go to
    every stale row of ``targets[i]``."""

    rows: list[int]
    starts: list[int]
    ends: list[int]
    targets: list[list[int]]


def _from_cache(prompts: list[tuple[int, ...]], cached: list[list[int]]) -> list[tuple[int, int]]:
    """For each prompt, ``(cache row, q)``: the cached row holding its longest beginning and the
    tokens it copies, ``q <= len - 1`` (``(-1, 0)``: none worth a copy, :data:`MIN_CACHED`). The
    longest common beginning with a set of token lists is with a neighbour in sorted order."""
    limit = max(map(len, prompts), default=0)  # no prompt shares more than its length
    ranked = sorted((tuple(v[:limit]), row) for row, v in enumerate(cached))
    out = []
    for p in prompts:
        at = bisect_left(ranked, (p, -1))
        row, q = -1, 0
        for v, r in ranked[max(0, at - 1): at + 1]:
            share = min(common_prefix(p, v), len(p) - 1)
            if share > q:
                row, q = r, share
        out.append((row, q) if q >= MIN_CACHED or (q and q == len(p) - 1) else (-1, 0))
    return out


def plan_prefill(tokens: list[list[int]], prompt_lens: list[int], cached: list[list[int]],
                 first_row: int) -> list[Copy | Forward]:
    """The copies and forwards, in order, that build the cache rows ``first_row ..`` of the
    stale rows and give each its next-token logits.

    Args:
        tokens: each stale row's prompt + the tokens it generated so far (stale row ``r`` lives
            in cache row ``first_row + r``).
        prompt_lens: each stale row's prompt length, tokens.
        cached: the tokens each cache row ``0 .. first_row - 1`` holds at positions ``0 ..``,
            valid under the current weights.
        first_row: the cache row of stale row 0.

    Returns:
        Steps to run in order; every stale row is a target of a forward that covers its last
        token, the last such (later forwards overwrite earlier targets).

    Raises:
        ValueError: more cached rows than ``first_row`` (a copy could read a row being rebuilt).
    """
    if len(cached) > first_row:
        raise ValueError(f"plan_prefill: {len(cached)} cached rows lie below the first stale row {first_row}")
    prompts = [tuple(t[:n]) for t, n in zip(tokens, prompt_lens)]
    groups: dict[tuple[int, ...], list[int]] = {}  # prompt -> its stale rows, in order
    for r, p in enumerate(prompts):
        groups.setdefault(p, []).append(r)
    distinct = list(groups)
    firsts = [groups[p][0] for p in distinct]
    source = _from_cache(distinct, cached)
    root = {}  # branch -> (its root, tokens shared with it), step 3
    order, shared = share_prefixes([list(p) for p in distinct])
    top = -1  # the root of the cluster being read (its first row has q == 0)
    for i, q in zip(order, shared):
        top = i if q == 0 else top
        if q > source[i][1]:  # more from its root than from the cache
            root[i] = (top, q)
    if sum(q - source[i][1] for i, (_, q) in root.items()) < MIN_SKIPPED:
        root = {}
    steps: list[Copy | Forward] = []
    alone = [i for i in range(len(distinct)) if i not in root]
    copied = [i for i in alone if source[i][1]]
    if copied:
        steps.append(Copy([source[i][0] for i in copied], [first_row + firsts[i] for i in copied],
                          [source[i][1] for i in copied]))
    steps.append(Forward([firsts[i] for i in alone], [source[i][1] for i in alone],
                         [len(distinct[i]) for i in alone], [groups[distinct[i]] for i in alone]))
    if root:
        branches = list(root)
        steps.append(Copy([first_row + firsts[root[i][0]] for i in branches], [first_row + firsts[i] for i in branches],
                          [root[i][1] for i in branches]))
        steps.append(Forward([firsts[i] for i in branches], [root[i][1] for i in branches],
                             [len(distinct[i]) for i in branches], [groups[distinct[i]] for i in branches]))
    members = [(rows[0], r) for rows in groups.values() for r in rows[1:]]
    if members:
        steps.append(Copy([first_row + a for a, _ in members], [first_row + b for _, b in members],
                          [prompt_lens[b] for _, b in members]))
    grown = [r for r in range(len(tokens)) if len(tokens[r]) > prompt_lens[r]]
    if grown:
        steps.append(Forward(grown, [prompt_lens[r] for r in grown], [len(tokens[r]) for r in grown],
                             [[r] for r in grown]))
    return steps


def prefix_rows(rows: list) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The decode side of the plan's copies: ``(prefix_rows, prefix_lens)`` int64 ``[len(rows)]``
    for ``decode_attention``, each row's first positions read from the live row it copied them
    from (a GRPO group's rows then read one copy of their prompt), else from its own.

    Args:
        rows: the decode step's sequences in cache-row order; each has ``prefix``: None or
            ``(source sequence, n)`` set when a :class:`Copy` gave it the source's first ``n``
            positions. A source no longer among ``rows`` (finished) is not read.

    Returns:
        None when no row reads another's.
    """
    row_of = {id(seq): r for r, seq in enumerate(rows)}  # a source held by .prefix keeps its id unique
    src, lens = list(range(len(rows))), [0] * len(rows)
    for r, seq in enumerate(rows):
        if seq.prefix is not None and id(seq.prefix[0]) in row_of:
            src[r], lens[r] = row_of[id(seq.prefix[0])], seq.prefix[1]
    if not any(lens):
        return None
    return torch.tensor(src), torch.tensor(lens)
