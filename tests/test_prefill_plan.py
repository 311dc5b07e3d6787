"""The engine's prefill plan: which rows compute which tokens, which copy (hand-computed plans)."""

from runtime.engines.prefill_plan import MIN_SKIPPED, Copy, Forward, plan_prefill

SYSTEM = list(range(100, 140))  # a 40-token shared prefix, as a chat template's system turn


def test_a_group_computes_its_prompt_once_and_the_others_copy_it():
    # two groups of two; the prompts share nothing: one forward of the two firsts, then copies
    tokens = [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]
    assert plan_prefill(tokens, [3, 3, 2, 2], {}, 0) == [
        Forward([0, 2], [0, 0], [3, 2], [[0, 1], [2, 3]]),
        Copy([0, 2], [1, 3], 3),
    ]


def test_distinct_prompts_with_a_long_common_prefix_compute_it_once():
    # root sys+[1,2] whole (42 tokens); the others copy its 40 shared tokens and compute 1 and 3
    tokens = [SYSTEM + [1, 2], SYSTEM + [3], SYSTEM + [4, 5, 6]]
    assert 2 * 40 >= MIN_SKIPPED
    assert plan_prefill(tokens, [42, 41, 43], {}, 5) == [
        Forward([0], [0], [42], [[0]]),
        Copy([5, 5], [6, 7], 40),
        Forward([1, 2], [40, 40], [41, 43], [[1], [2]]),
    ]


def test_a_prompt_that_is_a_prefix_of_the_others_is_their_root_and_each_branch_keeps_a_token():
    # sorted: sys (40) < sys+[1] (41): root sys whole, then sys+[1] shares 40; sys+[2]+[9] shares 40
    tokens = [SYSTEM + [2, 9], SYSTEM, SYSTEM + [1]]
    steps = plan_prefill(tokens, [42, 40, 41], {}, 0)
    assert steps == [
        Forward([1], [0], [40], [[1]]),
        Copy([1, 1], [2, 0], 40),
        Forward([2, 0], [40, 40], [41, 42], [[2], [0]]),
    ]


def test_a_short_common_prefix_is_not_worth_a_second_forward():
    short = SYSTEM[:20]  # two branches would skip 40 < MIN_SKIPPED tokens
    tokens = [short + [1], short + [2], short + [3]]
    assert 2 * 20 < MIN_SKIPPED
    assert plan_prefill(tokens, [21, 21, 21], {}, 0) == [Forward([0, 1, 2], [0, 0, 0], [21, 21, 21],
                                                                 [[0], [1], [2]])]


def test_held_prompts_are_copied_and_their_last_token_fed_again():
    # prompt [7, 8, 9] held by cache row 2; row 0 also has two tokens of its own (after an update)
    tokens = [[7, 8, 9, 1, 1], [7, 8, 9]]
    assert plan_prefill(tokens, [3, 3], {(7, 8, 9): 2}, 4) == [
        Copy([2, 2], [4, 5], 3),
        Forward([0, 1], [2, 2], [5, 3], [[0], [1]]),
    ]


def test_after_an_update_a_group_recomputes_its_prompt_once_then_each_row_its_own_tokens():
    tokens = [[7, 8, 9, 4], [7, 8, 9, 5, 6]]
    assert plan_prefill(tokens, [3, 3], {}, 0) == [
        Forward([0], [0], [3], [[0, 1]]),
        Copy([0], [1], 3),
        Forward([0, 1], [3, 3], [4, 5], [[0], [1]]),
    ]


def test_two_clusters_each_branch_copies_from_its_own_root_as_much_as_it_shares():
    # sorted: a+[1] (row 3), a+[2] (1), b+[1] (2), b+[1,5] (4), b+[2,3] (0); each one's common prefix
    # with the one before: 40, 0, 41, 40. Two clusters, roots rows 3 and 2. Row 1 shares 40 with row 3;
    # row 4 shares 41 with row 2 (all of b+[1], and keeps its last token); row 0 shares min(41, 40) = 40
    # with row 2. One copy of the longest share (41) from each branch's own root; two forwards.
    a, b = [1] * 40, [9] * 40
    tokens = [b + [2, 3], a + [2], b + [1], a + [1], b + [1, 5]]
    lens = [42, 41, 41, 41, 42]
    # sorted: a+[1] (3), a+[2] (1), b+[1] (2), b+[1,5] (4), b+[2,3] (0); LCPs to the previous: 40, 0, 41, 40
    assert plan_prefill(tokens, lens, {}, 10) == [
        Forward([3, 2], [0, 0], [41, 41], [[3], [2]]),
        Copy([13, 12, 12], [11, 14, 10], 41),
        Forward([1, 4, 0], [40, 41, 40], [41, 42, 42], [[1], [4], [0]]),
    ]
