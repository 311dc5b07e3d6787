"""Shared prefixes of a packed micro-batch: rows that begin with the same tokens run them once.

Every sample of a GRPO group repeats its group's prompt, so a packed micro-batch of ``G``
groups of ``n`` samples computes each prompt ``n`` times. In a causal LM a token's hidden
state depends only on the tokens before it, so rows that begin alike have the same hidden
states over their common prefix: the prefix can run once (the group's *root* row, whole) and
each other row (a *branch*) runs only its own tail, attending to the root's first ``q``
tokens and then causally to itself. Log-probs are the same numbers as the rows run apart, and
so is the gradient (the prefix's gradient is the sum of what each row sends back through it).
This is the shared-prefix forward of Prefix Grouper (Liu et al. 2025, "Prefix Grouper:
Efficient GRPO Training through Shared-Prefix Forward", arXiv:2506.05433, Sec. 3) and NeMo
RL's ``shared_prefix_training``; here it is found from the tokens alone, so it serves every
algorithm (a group's prompt, a multi-turn trajectory's shared turns, or nothing).

Which rows share with which: the micro-batch's rows are sorted by their tokens, so rows with
long common prefixes sit next to each other, and cut into consecutive clusters; a cluster's
first row is its root and every other row ``k`` shares ``q_k = min(LCP(root, k), n_k - 1)``
tokens with it (a branch keeps one token of its own at least). The cut that computes the
fewest tokens is found exactly by dynamic programming over the sorted rows (a cluster spans at
most :data:`MAX_CLUSTER` rows, which bounds the work at ``B x MAX_CLUSTER`` steps).
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_CLUSTER = 256
"""Most rows one root serves (the dynamic program's window)."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens the two token lists have in common from the start (their LCP), tokens."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _shares(lcp: int, length: int) -> int:
    """Tokens a branch of ``length`` tokens with ``lcp`` in common with its root takes from it:
    all of the common prefix but the branch's last token (a branch keeps one of its own)."""
    return max(0, min(lcp, length - 1))


def share_prefixes(tokens: list[list[int]]) -> tuple[list[int], list[int]]:
    """The order and shared lengths of rows with ``tokens`` (each row's real tokens).

    Args:
        tokens: one list of token ids per row (its prompt + response, no padding).

    Returns:
        ``(order, shared)``: ``order`` lists the row indices, each cluster's root first and its
        branches after it; ``shared[i]`` is how many leading tokens row ``order[i]`` takes from
        its root (the last row before it with ``shared == 0``): 0 for a root, else ``1 <= q <
        len(row)`` and ``q <=`` the root's length. The order and ``shared`` minimise the
        tokens computed, ``sum(len(row) - shared)``, over every cut of the sorted rows into
        consecutive clusters of at most :data:`MAX_CLUSTER` rows.
    """
    order = sorted(range(len(tokens)), key=lambda r: tokens[r])
    n = [len(tokens[r]) for r in order]
    # lcp[k]: tokens sorted row k has in common with sorted row k - 1 (0 for k = 0)
    lcp = [0] + [common_prefix(tokens[order[k - 1]], tokens[order[k]]) for k in range(1, len(order))]
    inf = float("inf")
    best = [0.0] + [inf] * len(order)  # best[j]: fewest tokens computed for sorted rows [0, j)
    cut = [0] * (len(order) + 1)  # cut[j]: where the last cluster of best[j] starts
    for i in range(len(order)):  # best[i] is final here: every cluster ending at i starts before it
        total, run = 0, 10**18  # tokens of cluster [i, j]; LCP(root i, row j) = min(lcp[i + 1 .. j])
        for j in range(i, min(len(order), i + MAX_CLUSTER)):
            if j > i:
                run = min(run, lcp[j])
            total += n[j] - (_shares(run, n[j]) if j > i else 0)
            if best[i] + total < best[j + 1]:
                best[j + 1], cut[j + 1] = best[i] + total, i
            if run == 0:  # row j shares nothing with root i: a longer cluster saves nothing more
                break
    clusters, j = [], len(order)
    while j > 0:
        clusters.append((cut[j], j))
        j = cut[j]
    out_order, shared = [], []
    for i, j in reversed(clusters):
        run = 10**18
        for k in range(i, j):
            if k > i:
                run = min(run, lcp[k])
            out_order.append(order[k])
            shared.append(0 if k == i else _shares(run, n[k]))
    return out_order, shared


def shared_clusters(tokens: list[list[int]], budget: int = 0) -> list[list[tuple[int, int]]]:
    """:func:`share_prefixes` of rows with ``tokens`` as clusters ``[(row, shared), ...]`` (root
    first), each cut into consecutive pieces that compute at most ``budget`` tokens (0: no cut;
    a single row longer than it stays a piece alone). A piece's first row becomes its root:
    in token order every later row shares at least as much with it as with the old root.
    """
    pieces: list[list[tuple[int, int]]] = []
    load = 0
    for r, q in zip(*share_prefixes(tokens)):
        if q == 0 or (budget and load + len(tokens[r]) - q > budget):
            pieces.append([])
            q, load = 0, 0
        pieces[-1].append((r, q))
        load += len(tokens[r]) - q
    return pieces
