"""The engine's prefill plan: which rows compute which tokens, which copy (hand-computed plans)."""

import random

import pytest

from areal_flow.algorithms.shared_prefix import common_prefix
from runtime.engines.prefill_plan import MIN_CACHED, MIN_SKIPPED, Copy, Forward, _from_cache, plan_prefill

SYSTEM = list(range(100, 140))  # a 40-token shared prefix, as a chat template's system turn


def test_a_group_computes_its_prompt_once_and_the_others_copy_it():
    # two groups of two; the prompts share nothing: one forward of the two firsts, then copies
    tokens = [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]
    assert plan_prefill(tokens, [3, 3, 2, 2], [], 0) == [
        Forward([0, 2], [0, 0], [3, 2], [[0, 1], [2, 3]]),
        Copy([0, 2], [1, 3], [3, 2]),
    ]


def test_distinct_prompts_with_a_long_common_prefix_compute_it_once():
    # root sys+[1,2] whole (42 tokens); the others copy its 40 shared tokens and compute 1 and 3
    tokens = [SYSTEM + [1, 2], SYSTEM + [3], SYSTEM + [4, 5, 6]]
    assert 2 * 40 >= MIN_SKIPPED
    assert plan_prefill(tokens, [42, 41, 43], [], 5) == [
        Forward([0], [0], [42], [[0]]),
        Copy([5, 5], [6, 7], [40, 40]),
        Forward([1, 2], [40, 40], [41, 43], [[1], [2]]),
    ]


def test_a_prompt_that_is_a_prefix_of_the_others_is_their_root_and_each_branch_keeps_a_token():
    # sorted: sys (40) < sys+[1] (41): root sys whole, then sys+[1] shares 40; sys+[2]+[9] shares 40
    tokens = [SYSTEM + [2, 9], SYSTEM, SYSTEM + [1]]
    steps = plan_prefill(tokens, [42, 40, 41], [], 0)
    assert steps == [
        Forward([1], [0], [40], [[1]]),
        Copy([1, 1], [2, 0], [40, 40]),
        Forward([2, 0], [40, 40], [41, 42], [[2], [0]]),
    ]


def test_a_short_common_prefix_is_not_worth_a_second_forward():
    short = SYSTEM[:20]  # two branches would skip 40 < MIN_SKIPPED tokens
    tokens = [short + [1], short + [2], short + [3]]
    assert 2 * 20 < MIN_SKIPPED
    assert plan_prefill(tokens, [21, 21, 21], [], 0) == [Forward([0, 1, 2], [0, 0, 0], [21, 21, 21],
                                                                 [[0], [1], [2]])]


def test_a_prompt_a_cached_row_holds_is_copied_but_its_last_token():
    # cache row 2 holds [7, 8, 9] and a token of its own; both stale rows have the prompt [7, 8, 9]
    # (row 0 also two tokens of its own): the first copies 2 tokens and computes the last, row 1
    # copies the prompt from it, row 0 then computes its own two
    tokens = [[7, 8, 9, 1, 1], [7, 8, 9]]
    assert plan_prefill(tokens, [3, 3], [[5], [5, 6], [7, 8, 9, 4]], 3) == [
        Copy([2], [3], [2]),
        Forward([0], [2], [3], [[0, 1]]),
        Copy([3], [4], [3]),
        Forward([0], [3], [5], [[0]]),
    ]
    with pytest.raises(ValueError, match="3 cached rows lie below the first stale row 2"):
        plan_prefill(tokens, [3, 3], [[5], [5, 6], [7, 8, 9, 4]], 2)


def test_a_new_prompt_copies_the_system_turn_from_a_cached_row_of_another_prompt():
    # cache row 1 decodes SYSTEM + [1, 2] (+ 3 tokens); the new prompt SYSTEM + [5, 6] copies the 40
    # shared tokens, more than MIN_CACHED, and computes 2; a beginning of 10 tokens is not copied
    tokens = [SYSTEM + [5, 6], SYSTEM[:10] + [7, 7]]
    assert plan_prefill(tokens, [42, 12], [[3] * 5, SYSTEM + [1, 2, 3, 3, 3]], 2) == [
        Copy([1], [2], [40]),
        Forward([0, 1], [40, 0], [42, 12], [[0], [1]]),
    ]


def test_after_an_update_a_group_recomputes_its_prompt_once_then_each_row_its_own_tokens():
    tokens = [[7, 8, 9, 4], [7, 8, 9, 5, 6]]
    assert plan_prefill(tokens, [3, 3], [], 0) == [
        Forward([0], [0], [3], [[0, 1]]),
        Copy([0], [1], [3]),
        Forward([0, 1], [3, 3], [4, 5], [[0], [1]]),
    ]


def test_two_clusters_each_branch_copies_from_its_own_root_as_much_as_it_shares():
    # sorted: a+[1] (row 3), a+[2] (1), b+[1] (2), b+[1,5] (4), b+[2,3] (0); each one's common prefix
    # with the one before: 40, 0, 41, 40. Two clusters, roots rows 3 and 2. Row 1 shares 40 with row 3;
    # row 4 shares 41 with row 2 (all of b+[1], and keeps its last token); row 0 shares min(41, 40) = 40
    # with row 2. The roots first (in the batch's order), then one copy of the longest share (41) from
    # each branch's own root, then the branches (in sorted order).
    a, b = [1] * 40, [9] * 40
    tokens = [b + [2, 3], a + [2], b + [1], a + [1], b + [1, 5]]
    lens = [42, 41, 41, 41, 42]
    # sorted: a+[1] (3), a+[2] (1), b+[1] (2), b+[1,5] (4), b+[2,3] (0); LCPs to the previous: 40, 0, 41, 40
    assert plan_prefill(tokens, lens, [], 10) == [
        Forward([2, 3], [0, 0], [41, 41], [[2], [3]]),
        Copy([13, 12, 12], [11, 14, 10], [40, 41, 40]),
        Forward([1, 4, 0], [40, 41, 40], [41, 42, 42], [[1], [4], [0]]),
    ]


def _replay(steps, tokens: list[list[int]], cached: list[list[int]], first_row: int):
    """Run a plan on a symbolic cache: position i of a row holds ``(prefix, origin)``: the token
    prefix its key/value is a function of (``("garbage",)``: none) and which forward and row wrote
    it (a copy keeps the origin, so equal origins mean the same bits). A forward must find every
    position before its start valid; returns the cache rows and each stale row's logits (the
    prefix they are a function of)."""
    width = first_row + len(tokens)
    cache = [[(tuple(v[: i + 1]), ("cached", c)) for i in range(len(v))] + [(None, None)] * 200
             for c, v in enumerate(cached)]
    cache += [[(("garbage",), None)] * 250 for _ in range(len(tokens))]
    logits = [None] * len(tokens)
    for n, step in enumerate(steps):
        if isinstance(step, Copy):
            assert len(set(step.src) & set(step.dst)) == 0 and all(first_row <= d < width for d in step.dst)
            assert all(k > 0 for k in step.lengths)
            taken = [list(cache[s][: step.length]) for s in step.src]
            for d, values in zip(step.dst, taken):
                cache[d][: step.length] = values
            continue
        padded = max(e - s for s, e in zip(step.starts, step.ends))
        for r, start, end, targets in zip(step.rows, step.starts, step.ends, step.targets):
            row = cache[first_row + r]
            assert all(row[i][0] == tuple(tokens[r][: i + 1]) for i in range(start)), (r, start)
            for p in range(start, end):
                row[p] = (tuple(tokens[r][: p + 1]), ("forward", n, r))
            if not any(step.starts):  # the whole-prompt path writes the padding too
                for p in range(end, padded):
                    row[p] = (("padding",), ("forward", n, r))
            for t in targets:
                logits[t] = tuple(tokens[r][:end])
    return cache, logits


def _kept_copies_are_the_sources_bits(steps, cache, tokens, first_row) -> None:
    """Every copied pair's ``lengths[i]`` positions lie within the destination's tokens (so they
    are checked valid with the rest) and end as the source row's, origin and all: the decode
    attention may read them from either row."""
    for step in steps:
        if isinstance(step, Copy):
            for s, d, k in zip(step.src, step.dst, step.lengths):
                assert k <= len(tokens[d - first_row]) and cache[d][:k] == cache[s][:k], (s, d, k)


def test_every_plan_builds_every_row_and_its_logits_on_random_batches():
    """Random batches: groups, prompts that begin alike, prompts that are prefixes of others, rows
    with tokens of their own, cached rows holding some prompts or their beginnings. Replayed on a
    symbolic cache, every stale row ends with all its positions right and its last token's logits,
    and every row keeps the positions a copy claims, bit for bit the source's."""
    rng = random.Random(0)
    beginnings = [[1] * 40, [2] * 30 + [3] * 10, [4] * 5, []]
    branched = from_cache = 0
    for case in range(3000):
        distinct = [rng.choice(beginnings) + [rng.randrange(5, 9) for _ in range(rng.randrange(1, 12))]
                    for _ in range(rng.randrange(1, 6))]
        prompts = [rng.choice(distinct) for _ in range(rng.randrange(1, 9))]
        tokens = [p + [9] * rng.choice([0, 0, 0, 1, 3]) for p in prompts]
        cached = [rng.choice(distinct + beginnings[:1])[: rng.randrange(1, 60)] + [10]
                  for _ in range(rng.randrange(0, 3))]
        first_row = len(cached)
        steps = plan_prefill(tokens, [len(p) for p in prompts], cached, first_row)
        branched += any(isinstance(s, Forward) and any(s.starts) for s in steps)
        from_cache += any(isinstance(s, Copy) and min(s.src) < first_row for s in steps)
        cache, logits = _replay(steps, tokens, cached, first_row)
        for r, t in enumerate(tokens):
            assert all(cache[first_row + r][i][0] == tuple(t[: i + 1]) for i in range(len(t))), (case, r)
            assert logits[r] == tuple(t), (case, r)
        _kept_copies_are_the_sources_bits(steps, cache, tokens, first_row)
    assert branched > 500 and from_cache > 300  # the batches do exercise copies and continued forwards


def test_a_prompt_finds_the_cached_row_that_shares_the_most_of_its_beginning():
    """Against every cached row tried in turn: the longest share, capped at the prompt's length - 1,
    taken at MIN_CACHED tokens or more or when it is the whole prompt but its last token."""
    rng = random.Random(1)
    for _ in range(3000):
        stem = [rng.randrange(2) for _ in range(rng.randrange(0, 24))]
        grow = lambda: stem[: rng.randrange(len(stem) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 6))]
        cached = [grow() for _ in range(rng.randrange(0, 6))]
        prompts = [tuple(p) for p in (grow() for _ in range(4)) if p]
        for p, (row, q) in zip(prompts, _from_cache(prompts, cached)):
            best = max((min(common_prefix(p, v), len(p) - 1) for v in cached), default=0)
            taken = best if best >= MIN_CACHED or (best and best == len(p) - 1) else 0
            assert q == taken, (p, cached, row, q)
            if q:
                assert min(common_prefix(p, cached[row]), len(p) - 1) == q
            else:
                assert row == -1
