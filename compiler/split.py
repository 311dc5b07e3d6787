"""Split layouts: a critic's side on a mesh of its own, beside generation and the policy's side.

Owns the enumeration of the third layout family of ``compiler.search``: in a graph with a
critic (``DeviceTask.critic``), generation on ``a`` devices, the policy's training side on
``b1`` and the critic's side (its train_step and the nodes that read its values, e.g. the
advantage node) on ``b2``, three disjoint meshes. The two training sides run concurrently
(each step group trains while the other does, as ReaLHF runs actor and critic on their own
meshes), so ``compiler.search._Search.layout`` counts the slower side per step. The
runtime runs these plans: a critic on ranks of its own is ``runtime.trainer_ranks``'s.

Pruning keeps the family exact: a triple's step is at least
``step(G_lb(a), max(P(b1), C(b2)), 0)`` (``G_lb`` the generation floor, ``P``/``C`` each side's
seconds, bounded below by its FLOPs floor). For each ``a``, ``b1`` runs largest first until
the bound with the policy's floor exceeds the search's threshold; for each ``(a, b1)``, ``b2``
runs largest first until the critic's floor exceeds the fastest critic side found for that
pair: the step and the serial time grow with ``C`` and, while the meshes pack in the order
given, nothing else of the layout depends on ``b2``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

from compiler.mesh import MeshError, MeshSpec, pack
from compiler.step import step_time
from compiler.workload import DeviceTask


def critic_side(train: list[DeviceTask]) -> list[DeviceTask]:
    """The training-side tasks of the critics' models (their train_steps and the nodes that read
    them), when the policy's side keeps at least one task; else ``[]`` (no split layout)."""
    critics = {t.model_name for t in train if t.critic}
    side = [t for t in train if t.model_name in critics]
    return side if len(side) < len(train) else []


def split_layouts(s, sizes: list[int], overlapped: bool, threshold: Callable[[], float],
                  generation_s: Callable[[int], float | None], generation_lb: Callable[[int], float],
                  ) -> Iterator[tuple[list[list[DeviceTask]], list[MeshSpec]]]:
    """``([gen, policy side, critic side], meshes)`` of every split layout that may enter the
    search's result (module doc); ``threshold`` is read after each yield, as the caller's
    results tighten it.

    Args:
        s: the search's ``compiler.search._Search`` (its tasks, ``training_side``, cost model).
        sizes: the aligned mesh sizes, ascending.
        overlapped: generation and training overlap (k >= 1 and no mixed mesh).
        threshold: the ``top_k``-th best step found so far (seconds).
        generation_s: the generation side's best seconds on ``a`` devices, None if it fits none.
        generation_lb: a lower bound on ``generation_s``.
    """
    model = s.model
    critic = critic_side(s.train)
    if not (s.gen and critic):
        return
    sides = {False: [t for t in s.train if t not in critic], True: critic}
    cluster, per = model.cluster, model.per_node
    total = model.total_devices

    @functools.cache
    def floor(is_critic: bool, size: int) -> float:
        return sum(model.compute_floor(t, size) for t in sides[is_critic])

    @functools.cache
    def seconds(is_critic: bool, size: int) -> float | None:
        costs = s.training_side(sides[is_critic], size, len(sides[is_critic]) > 1)
        return None if costs is None else sum(c.time_s for c in costs.values())

    for a in sizes:
        if a >= total or generation_s(a) is None:
            continue
        g = generation_lb(a)
        for b1 in reversed(sizes):  # floors grow as sizes shrink
            if a + b1 >= total:
                continue
            if step_time(g, floor(False, b1), 0.0, overlapped) > threshold():
                break
            p = seconds(False, b1)
            if p is None or step_time(g, p, 0.0, overlapped) > threshold():
                continue
            best_c = float("inf")  # the fastest critic side found for this (a, b1)
            for b2 in reversed(sizes):
                if a + b1 + b2 > total:
                    continue
                low = floor(True, b2)
                if low > best_c or step_time(g, max(p, low), 0.0, overlapped) > threshold():
                    break
                c = seconds(True, b2)
                if c is None or c > best_c:
                    continue
                try:
                    meshes = pack([a, b1, b2], cluster.n_nodes, per)
                except MeshError:
                    continue
                best_c = c
                yield [s.gen, sides[False], critic], meshes
