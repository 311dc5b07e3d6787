"""Search over allocations and per-node strategies for the fastest steady-state step.

Owns the enumeration. Layouts: *colocated* (all device nodes time-share one aligned mesh,
of every aligned size) and *disaggregated* (generation nodes on one mesh, training and
inference nodes on a disjoint one, every pair of aligned sizes that packs onto the
cluster). For each layout, strategies are chosen per node, exactly:

- the objective (``compiler.step``) and its tie-breaker (the serial time) grow with every
  training-side node's seconds and do not otherwise depend on its strategy, so each
  training-side node takes its fastest strategy that fits;
- a generation node's strategy changes its seconds and, through its DP degree, the weight
  sync (each device receives ``bytes * dp / mesh size``; the trainers send ``dp`` copies),
  both growing with ``dp``; only strategies on the (seconds, dp) Pareto front can be
  optimal, and their combinations are all tried.

Memoized by (node, mesh size), a 1024-device cluster takes well under the 2 s budget
(``bench/compile_search.py``). Candidates are ranked by :func:`rank_key` (step time, then
the serial time, then the allocation string), so the result is deterministic. On devices that host one engine each (``cpu``) colocated layouts are tried
only when no disaggregated one fits.
"""

from __future__ import annotations

import itertools

from compiler.cost import CostModel, NodeCost
from compiler.errors import InfeasiblePlanError, shortfall
from compiler.mesh import MeshError, MeshSpec, aligned_sizes, pack
from compiler.step import Candidate, allocation_string, evaluate, same_machine, step_time
from compiler.strategy import ParallelStrategy
from compiler.workload import GENERATION, DeviceTask


class _Search:
    def __init__(self, model: CostModel, pins: dict[str, ParallelStrategy]):
        self.model = model
        self.pins = pins
        self.gen = [t for t in model.workload.tasks if t.role == GENERATION]
        self.train = [t for t in model.workload.tasks if t.role != GENERATION]
        self._best: dict = {}
        self._front: dict = {}
        self.trainer_of = {t.model_name: t for t in self.train if t.op == "train_step"}

    def _options(self, task: DeviceTask, size: int, shared: bool) -> list[NodeCost]:
        pin = self.pins.get(task.node)
        strategies = ([pin] if pin.world_size == size else []) if pin else self.model.strategies(task, size)
        return [c for c in (self.model.cost(task, s, shared) for s in strategies) if c.fits]

    def best(self, task: DeviceTask, size: int, shared: bool) -> NodeCost | None:
        """Fastest fitting cost of a training-side node (ties: strategy string)."""
        key = (task.node, size, shared)
        if key not in self._best:
            options = self._options(task, size, shared)
            self._best[key] = min(options, key=lambda c: (c.time_s, c.strategy.short()), default=None)
        return self._best[key]

    def front(self, task: DeviceTask, size: int, shared: bool) -> list[NodeCost]:
        """Generation costs not beaten on both seconds and DP degree."""
        key = (task.node, size, shared)
        if key not in self._front:
            kept, best_time = [], float("inf")
            for c in sorted(self._options(task, size, shared), key=lambda c: (c.strategy.dp, c.time_s, c.strategy.short())):
                if c.time_s < best_time:
                    kept.append(c)
                    best_time = c.time_s
            self._front[key] = kept
        return self._front[key]

    def layout(self, groups_tasks: list[list[DeviceTask]], meshes: list[MeshSpec]):
        """Best ``(step, serial, groups)`` for one layout, or None if nothing fits (see ``rank_key``)."""
        chosen: dict[str, NodeCost] = {}
        for tasks, mesh in zip(groups_tasks, meshes):
            shared = len(tasks) > 1
            for task in tasks:
                if task.role != GENERATION:
                    cost = self.best(task, mesh.size, shared)
                    if cost is None:
                        return None
                    chosen[task.node] = cost
        fronts, gen_mesh = [], {}
        for tasks, mesh in zip(groups_tasks, meshes):
            for task in tasks:
                if task.role == GENERATION:
                    fronts.append(self.front(task, mesh.size, len(tasks) > 1))
                    gen_mesh[task.node] = mesh
        train_mesh = {t.node: m for tasks, m in zip(groups_tasks, meshes) for t in tasks if t.role != GENERATION}
        train_s = max(sum(chosen[t.node].time_s for t in tasks if t.role != GENERATION) for tasks in groups_tasks)
        mixed = any(len({t.role == GENERATION for t in tasks}) > 1 for tasks in groups_tasks)
        overlapped = self.model.workload.staleness >= 1 and not mixed
        best = None
        for combo in itertools.product(*fronts):
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

    def label(self, groups) -> str:
        return allocation_string(self.model.workload, groups)


def layouts(model: CostModel, gen: list[DeviceTask], train: list[DeviceTask]):
    """``(kind, groups of tasks, meshes)`` for every colocated and disaggregated layout."""
    c = model.cluster
    sizes = aligned_sizes(c.n_nodes, c.n_gpus_per_node)
    if gen and train:
        for a in sizes:
            for b in sizes:
                if a + b <= model.total_devices:
                    try:
                        yield "disaggregated", [gen, train], pack([a, b], c.n_nodes, c.n_gpus_per_node)
                    except MeshError:
                        continue
    for size in sizes:
        yield "colocated", [gen + train], pack([size], c.n_nodes, c.n_gpus_per_node)


def search(model: CostModel, pins: dict[str, ParallelStrategy], top_k: int) -> list[Candidate]:
    """The ``top_k`` best candidates, best first (step time, then allocation string).

    Args:
        pins: node -> strategy fixed in advance (its mesh size follows).

    Raises:
        InfeasiblePlanError: no layout fits; lists every node's smallest reachable memory.
    """
    s = _Search(model, pins)
    found = {"disaggregated": [], "colocated": []}
    for kind, groups_tasks, meshes in layouts(model, s.gen, s.train):
        if kind == "colocated" and model.device.one_engine_per_device and found["disaggregated"]:
            continue
        result = s.layout(groups_tasks, meshes)
        if result is not None:
            found[kind].append((result[:2], result[2], meshes))
    ranked = sorted(found["disaggregated"] + found["colocated"], key=lambda r: r[0])
    if not ranked:
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
