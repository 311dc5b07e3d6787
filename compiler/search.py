"""Search over allocations and per-node strategies for the fastest steady-state step.

Owns the enumeration, over the strategies the runtime can run only (``CostModel.strategies``
drops those ``compiler.executable`` refuses, so no candidate the runtime would refuse is
ranked). Layouts: *colocated* (all device nodes time-share one aligned mesh, of every
aligned size), *disaggregated* (generation nodes on one mesh, training and inference
nodes on a disjoint one, every pair of aligned sizes that packs onto the cluster) and, in a
graph with a critic, *split* (generation, the policy's training side, and the critic's side
-- its train_step and the nodes that read its values -- on three disjoint meshes, every
triple of aligned sizes that packs: the two training sides run concurrently, ReaLHF style,
so the step counts the slower of them). For each layout, strategies are chosen per node,
exactly:

- the objective (``compiler.step``) and its tie-breaker (the serial time) grow with every
  training-side node's seconds and do not otherwise depend on its strategy, so each
  training-side node takes its fastest strategy that fits, except that a critic's
  train_step and the policy's take the one strategy of least summed seconds that fits
  both: a critic on several devices runs on the policy trainer's ranks
  (``compiler.choose``; e.g. ``train:d2t4 | critic_step:d2t4`` when the critic fits no
  single device or trains faster sharded);
- a generation node's strategy changes its seconds and, through its DP degree, the weight
  sync (each device receives ``bytes * dp / mesh size``; the trainers send ``dp`` copies),
  both growing with ``dp``; only strategies on the (seconds, dp) Pareto front can be
  optimal, and their combinations are all tried.

Layouts that cannot enter the top-k are skipped by exact bounds and a dominance rule
(:func:`search`), and costs are memoized by (node, mesh size): a 4,096-device cluster
takes under the 2 s budget in async and sync mode (``bench/compile_search.py``). Candidates are
ranked by :func:`rank_key` (step time, then the serial time, then the allocation string),
so the result is deterministic. A layout the runtime cannot run (``compiler.hosting``) is
never a candidate. On devices that host one engine each (``cpu``) colocated
layouts are tried only when no disaggregated one fits.
"""

from __future__ import annotations

import bisect
import functools
import itertools

from compiler.choose import NodeChoice
from compiler.cost import CostModel, NodeCost
from compiler.errors import InfeasiblePlanError, shortfall
from compiler.hosting import hosting_problem, ray_hosting_problem, workload_hosting
from compiler.mesh import MeshError, MeshSpec, aligned_sizes, pack
from compiler.split import split_layouts
from compiler.step import Candidate, allocation_string, evaluate, same_machine, step_time
from compiler.strategy import ParallelStrategy
from compiler.workload import GENERATION, TRAINING, DeviceTask


class _Search(NodeChoice):
    def __init__(self, model: CostModel, pins: dict[str, ParallelStrategy]):
        super().__init__(model, pins)
        self.gen = [t for t in model.workload.tasks if t.role == GENERATION]
        self.train = [t for t in model.workload.tasks if t.role != GENERATION]
        self.trainer_of = {t.model_name: t for t in self.train if t.role == TRAINING}

    def layout(self, groups_tasks: list[list[DeviceTask]], meshes: list[MeshSpec]):
        """Best ``(step, serial, groups)`` for one layout, or None if nothing fits (see ``rank_key``)."""
        chosen: dict[str, NodeCost] = {}
        for tasks, mesh in zip(groups_tasks, meshes):
            costs = self.training_side([t for t in tasks if t.role != GENERATION], mesh.size, len(tasks) > 1)
            if costs is None:
                return None
            chosen.update(costs)
        fronts, gen_mesh = [], {}
        for tasks, mesh in zip(groups_tasks, meshes):
            for task in tasks:
                if task.role == GENERATION:
                    gen_mesh[task.node] = mesh
        train_mesh = {t.node: m for tasks, m in zip(groups_tasks, meshes) for t in tasks if t.role != GENERATION}
        train_s = max(sum(chosen[t.node].time_s for t in tasks if t.role != GENERATION) for tasks in groups_tasks)
        mixed = any(len({t.role == GENERATION for t in tasks}) > 1 for tasks in groups_tasks)
        overlapped = self.model.workload.staleness >= 1 and not mixed
        best = None
        for combo in self._combos(groups_tasks, meshes, fronts, train_s, overlapped, train_mesh, gen_mesh):
            if combo is None:  # the remaining options' bounds exceed the best step found
                break
            picks = dict(zip(gen_mesh, combo))
            gen_s = max(sum(picks[t.node].time_s for t in tasks if t.role == GENERATION) for tasks in groups_tasks)
            sync_s = 0.0
            for task in self.gen:
                src = self.trainer_of.get(task.model_name)
                if src is not None:
                    src_mesh = train_mesh[src.node]
                    sync_s += self.model.sync(
                        src, picks[task.node].strategy, src_mesh.size, same_machine(src_mesh, gen_mesh[task.node])
                    )[0]
            key = (step_time(gen_s, train_s, sync_s, overlapped), gen_s + train_s + sync_s)
            if best is None or key <= best[:2]:
                groups = [[(t, (picks | chosen)[t.node].strategy) for t in tasks] for tasks in groups_tasks]
                if best is None or key < best[:2] or self.label(groups) < self.label(best[2]):
                    best = (*key, groups)
        return best

    def _combos(self, groups_tasks, meshes, fronts, train_s, overlapped, train_mesh, gen_mesh):
        """The generation options to try: with one generation node, every strategy in the
        order of its bound ``step(generation_floor, T, exact sync)``, yielding None once the
        bound exceeds the best step so far (the caller stops there); otherwise every
        combination of the nodes' (seconds, dp) Pareto fronts."""
        gen = [t for tasks in groups_tasks for t in tasks if t.role == GENERATION]
        if len(gen) != 1:
            fronts = [self.front(t, gen_mesh[t.node].size, len(tasks) > 1)
                      for tasks in groups_tasks for t in tasks if t.role == GENERATION]
            yield from itertools.product(*fronts)
            return
        task, mesh = gen[0], gen_mesh[gen[0].node]
        shared = any(task in tasks and len(tasks) > 1 for tasks in groups_tasks)
        src = self.trainer_of.get(task.model_name)

        def sync_s(st):
            if src is None:
                return 0.0
            src_mesh = train_mesh[src.node]
            return self.model.sync(src, st, src_mesh.size, same_machine(src_mesh, mesh))[0]

        ranked = sorted(((step_time(self.model.generation_floor(task, st), train_s, sync_s(st), overlapped), st)
                         for st in self._strategies(task, mesh.size)), key=lambda x: x[0])
        best_step = float("inf")
        for bound, st in ranked:
            if bound > best_step:
                yield None
                return
            c = self.model.cost(task, st, shared)
            if c.fits:
                best_step = min(best_step, step_time(c.time_s, train_s, sync_s(st), overlapped))
                yield (c,)

    def label(self, groups) -> str:
        return allocation_string(self.model.workload, groups)



def _disaggregated_meshes(a: int, b: int, n_nodes: int, per_node: int) -> list[MeshSpec] | None:
    """``pack([a, b])``, with whole-machine pairs placed in closed form (machines
    ``0..a/per_node-1``, then the next ``b/per_node``), as first fit places them."""
    if a % per_node == 0 and b % per_node == 0:
        if a + b > n_nodes * per_node:
            return None
        return [MeshSpec(0, a // per_node, 0, per_node), MeshSpec(a // per_node, b // per_node, 0, per_node)]
    try:
        return pack([a, b], n_nodes, per_node)
    except MeshError:
        return None


def search(model: CostModel, pins: dict[str, ParallelStrategy], top_k: int) -> list[Candidate]:
    """The ``top_k`` best candidates, best first (step time, then allocation string).

    Layouts: colocated on every aligned size; disaggregated on every pair of aligned sizes
    ``(a, b)`` that packs (generation on ``a``, training on ``b``); with a critic, split on
    every triple ``(a, b1, b2)`` that packs (the policy's side on ``b1``, the critic's on
    ``b2``). Layouts are skipped only when they cannot enter the result, so the search stays
    exact (checked against brute force in ``tests/test_compiler_search.py``):

    - bound: a pair's step is at least ``step(G_lb(a), T_floor(b), 0)``, where ``T_floor``
      is the training side's FLOPs at the assumed MFU and ``G_lb`` a cheap generation floor
      (``CostModel.generation_floor``), then at least ``G + S`` of its best generation
      option counting only the receive side of the weight sync, then at least its step
      with ``T_floor(b)`` in place of the training seconds and the exact weight sync; a
      size where no training strategy fits memory is skipped. A pair (or a colocated size,
      whose step is ``G + T + S``) whose bound exceeds the ``top_k``-th best step found so
      far is skipped. The best-bounded splits of a grid of 16 are evaluated first so that
      this threshold is tight early; colocated layouts come last;
    - dominance: for a fixed ``a``, a whole-machine ``b`` is skipped when a larger
      whole-machine ``b'`` that fits beside ``a`` trains strictly faster: the weight sync of
      ``(a, b')`` is no slower (both cross the network; the trainers send ``dp`` copies over
      more devices) and the objective grows with training and sync seconds;
    - split triples: for each ``a``, the policy's sizes ``b1`` largest first until the bound
      with its floor exceeds the threshold; for each ``(a, b1)``, the critic's sizes ``b2``
      largest first until its floor exceeds the fastest critic side found for that pair
      (``compiler.split``).

    Args:
        pins: node -> strategy fixed in advance (its mesh size follows).

    Raises:
        InfeasiblePlanError: no layout fits; lists every node's smallest reachable memory (or, when
            every layout tried breaks a rule of ``compiler.hosting``, names a node and its rule; on
            Ray, ``model.scheduler``, when some were refused by ``ray-one-machine``, also one of those).
    """
    s = _Search(model, pins)
    c, per, total = model.cluster, model.per_node, model.total_devices
    sizes = aligned_sizes(c.n_nodes, per)
    overlapped = model.workload.staleness >= 1
    found = {"disaggregated": [], "colocated": []}
    steps: list[float] = []  # step times found, ascending: the top_k-th is the threshold
    tried: set = set()

    refused: dict[tuple, tuple | None] = {}  # by grouping (node, rule) or None: its shape does not depend on sizes
    on_ray: list[tuple[str, str]] = []  # (node, rule) of layouts Ray cannot place (they depend on sizes)

    def ray_problem(groups_tasks, meshes, chosen=None) -> bool:
        """On Ray, whether the layout breaks ``ray-one-machine`` (``chosen``: node -> strategy)."""
        if model.scheduler != "ray":
            return False
        label = {t.node: i for i, tasks in enumerate(groups_tasks) for t in tasks}
        mesh_of = {t.node: m for tasks, m in zip(groups_tasks, meshes) for t in tasks}
        problem = ray_hosting_problem(workload_hosting(model.workload, label, chosen), mesh_of)
        on_ray.extend([problem] if problem else [])
        return problem is not None

    def add(kind: str, groups_tasks, meshes) -> None:
        key = tuple(tuple(t.node for t in tasks) for tasks in groups_tasks)
        if key not in refused:
            label = {t.node: i for i, tasks in enumerate(groups_tasks) for t in tasks}
            refused[key] = hosting_problem(workload_hosting(model.workload, label))
        if refused[key] is not None or ray_problem(groups_tasks, meshes):
            return
        result = s.layout(groups_tasks, meshes)
        if result is not None and ray_problem(groups_tasks, meshes, {t.node: st for g in result[2] for t, st in g}):
            return
        if result is not None:
            found[kind].append((result[:2], result[2], meshes))
            bisect.insort(steps, result[0])

    def threshold() -> float:
        return steps[top_k - 1] if len(steps) >= top_k else float("inf")

    @functools.cache
    def generation_s(size: int) -> float | None:
        times = [s.fastest(t, size, len(s.gen) > 1) for t in s.gen]
        return None if any(t is None for t in times) else sum(times)

    @functools.cache
    def generation_sync_s(size: int, intra: bool) -> float:
        """A lower bound on G + S (<= the step) with generation on ``size`` devices: each
        generation node's best option counting its own weight sync's receive time."""
        total_s = 0.0
        for t in s.gen:
            src = s.trainer_of.get(t.model_name)
            best = s.fastest(t, size, len(s.gen) > 1, (lambda st: model.sync_floor(src, st, intra)) if src else None)
            total_s += float("inf") if best is None else best
        return total_s

    known: dict[int, float | None] = {}  # mesh size -> the training side's seconds

    def training_s(size: int) -> float | None:
        if size not in known:
            costs = s.training_side(s.train, size, len(s.train) > 1)
            known[size] = None if costs is None else sum(c.time_s for c in costs.values())
        return known[size]

    @functools.cache
    def floor_s(size: int) -> float:
        return sum(model.compute_floor(t, size) for t in s.train)

    @functools.cache
    def generation_lb(size: int) -> float:
        """A cheap lower bound on ``generation_s(size)`` (``CostModel.generation_floor``)."""
        return sum(min((model.generation_floor(t, st) for st in s._strategies(t, size)), default=float("inf"))
                   for t in s.gen)

    @functools.cache
    def trainable(size: int) -> bool:
        return all(any(model.can_fit(t, st) for st in s._strategies(t, size)) for t in s.train)

    def pair(a: int, b: int) -> None:
        if (a, b) not in tried:
            tried.add((a, b))
            meshes = _disaggregated_meshes(a, b, c.n_nodes, per)
            if meshes is not None:
                add("disaggregated", [s.gen, s.train], meshes)

    def pair_bound(a: int, b: int, train_s: float) -> float:
        """A lower bound on pair ``(a, b)``'s step if training took ``train_s`` (exact weight
        syncs; with one generation node, its strategies at ``CostModel.generation_floor``)."""
        meshes = _disaggregated_meshes(a, b, c.n_nodes, per)
        if meshes is None:
            return float("inf")
        intra = same_machine(*meshes)
        if len(s.gen) == 1:  # generation at its floor (no drain to cost), every strategy
            t = s.gen[0]
            src = s.trainer_of.get(t.model_name)
            return min((step_time(model.generation_floor(t, st), train_s,
                                  model.sync(src, st, b, intra)[0] if src else 0.0, overlapped)
                        for st in s._strategies(t, a)), default=float("inf"))
        best = float("inf")
        for combo in itertools.product(*(s.front(t, a, len(s.gen) > 1) for t in s.gen)):
            sync_s = sum(model.sync(s.trainer_of[t.model_name], o.strategy, b, intra)[0]
                         for t, o in zip(s.gen, combo) if t.model_name in s.trainer_of)
            best = min(best, step_time(sum(o.time_s for o in combo), train_s, sync_s, overlapped))
        return best

    may_colocate = not model.device.one_engine_per_device  # else only when nothing disaggregated fits

    def colocated(size: int) -> None:
        if ("colocated", size) not in tried:
            tried.add(("colocated", size))
            add("colocated", [s.gen + s.train], pack([size], c.n_nodes, per))

    if may_colocate and s.gen and s.train and not overlapped and trainable(total):
        colocated(total)  # without overlap, sharing every device is a strong first threshold
    if s.gen and s.train:
        whole = [a for a in sizes if a % per == 0 and a < total]
        grid = sorted({whole[i * (len(whole) - 1) // 15] for i in range(16)} if whole else ())
        grid = [a for a in grid if generation_s(a) is not None]
        for a in sorted(grid, key=lambda a: pair_bound(a, total - a, floor_s(total - a)))[: 2 * top_k]:
            if training_s(total - a) is not None:  # seeds: the best bounds on a grid of 16 splits
                pair(a, total - a)
        for a in sizes:
            if a >= total or floor_s(total - a) > threshold():
                continue  # even the most devices left for training cannot beat the threshold
            g = None  # the generation side is costed only once a b passes the cheaper checks
            fastest = float("inf")  # training seconds of the best larger whole-machine b
            for b in reversed(sizes):
                if a + b > total or ray_problem([s.gen, s.train], _disaggregated_meshes(a, b, c.n_nodes, per) or []):
                    continue  # (a pair Ray cannot place must not dominate a smaller b)
                if floor_s(b) > threshold():
                    break  # the floor only grows as b shrinks
                if b % per == 0 and floor_s(b) >= fastest or not trainable(b):
                    continue
                if g is None:
                    if step_time(generation_lb(a), floor_s(b), 0.0, overlapped) > threshold():
                        break  # floor_s only grows as b shrinks
                    g = generation_s(a)
                    if g is None or generation_sync_s(a, a < per) > threshold():
                        break  # (intra-node sync is possible only for a mesh inside one machine)
                if b not in known and pair_bound(a, b, floor_s(b)) > threshold():
                    continue
                t = training_s(b)
                if t is None or (b % per == 0 and t >= fastest):
                    continue
                fastest = t if b % per == 0 else fastest
                if step_time(g, t, 0.0, overlapped) <= threshold():
                    pair(a, b)
    for groups_tasks, meshes in split_layouts(s, sizes, overlapped, threshold, generation_s, generation_lb):
        add("disaggregated", groups_tasks, meshes)
    if not (model.device.one_engine_per_device and found["disaggregated"]):  # one engine each: colocate if must
        for size in sizes:  # a shared mesh's step is G + T + S, each node paying a swap
            if floor_s(size) + (generation_lb(size) if s.gen else 0.0) > threshold() or not trainable(size):
                continue
            g = generation_s(size) if s.gen else 0.0
            if g is not None and (generation_sync_s(size, size <= per) if s.gen else 0.0) + floor_s(size) <= threshold():
                colocated(size)
    ranked = sorted(found["disaggregated"] + found["colocated"], key=lambda r: r[0])
    if not ranked:
        problems = [p for p in refused.values() if p is not None]
        if refused and len(problems) == len(refused):  # no layout's shape runs, whatever the sizes
            raise InfeasiblePlanError(f"no placement of graph '{model.workload.graph_name}' runs: every layout breaks "
                                      f"a rule of compiler.hosting, e.g. node '{problems[0][0]}': {problems[0][1]}", [])
        if on_ray:  # layouts that might fit were refused for Ray: say so before the memory floors
            (node, why), floors = on_ray[0], _infeasible(model, pins).shortfalls
            raise InfeasiblePlanError(f"no layout of graph '{model.workload.graph_name}' runs on Ray within memory "
                                      f"(scheduler.type=ray): the others break a rule of compiler.hosting, e.g. node "
                                      f"'{node}': {why}; smallest memory per device each node can reach:", floors)
        raise _infeasible(model, pins)
    cut = min(top_k, len(ranked))
    while cut < len(ranked) and ranked[cut][0] == ranked[cut - 1][0]:
        cut += 1  # the allocation string breaks ties, so take every entry tied at the cut
    candidates = [evaluate(model, groups, meshes) for _, groups, meshes in ranked[:cut]]
    return sorted(candidates, key=rank_key)[:top_k]


def rank_key(c: Candidate) -> tuple[float, float, str]:
    """Order of candidates: step time, then the serial time G + T + S (the faster nodes win
    when one side bounds the step), then the allocation string."""
    return (c.step_time_s, c.generation_s + c.training_s + c.sync_s, c.allocation)


def _infeasible(model: CostModel, pins: dict[str, ParallelStrategy]) -> InfeasiblePlanError:
    c = model.cluster
    shortfalls = []
    for task in model.workload.tasks:
        pin = pins.get(task.node)
        cost = model.cost(task, pin, False) if pin else model.floor(task)
        shortfalls.append(shortfall(task, cost, model.usable, model.cfg))
    headline = (
        f"no allocation of {model.total_devices} device(s) ({c.n_nodes} x {c.n_gpus_per_node} {model.device.name}) "
        f"fits graph '{model.workload.graph_name}'; smallest memory per device each node can reach:"
    )
    return InfeasiblePlanError(headline, shortfalls)
