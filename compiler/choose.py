"""Each node's strategy on a mesh of a given size: the fastest that fits, memoized.

Owns the per-node choices ``compiler.search`` makes inside one layout (a node's mesh size and
whether it time-shares the mesh are given): a training-side node's fastest fitting strategy
(:meth:`NodeChoice.best`), the strategies of the training side of one mesh together
(:meth:`NodeChoice.training_side`: a critic's train_step on several devices shares the policy
train_step's strategy, ``compiler.hosting``'s rule ``critic-ranks``), and a generation node's
options (:meth:`NodeChoice.fastest`, :meth:`NodeChoice.front`). Strategies come from
``CostModel.strategies`` (what ``compiler.executable`` allows) or a pin. It chooses no meshes.
"""

from __future__ import annotations

from compiler.cost import CostModel, NodeCost
from compiler.strategy import ParallelStrategy
from compiler.workload import DeviceTask


class NodeChoice:
    """The memoized choices of one search (``model``; ``pins``: node -> strategy fixed in advance)."""

    def __init__(self, model: CostModel, pins: dict[str, ParallelStrategy]):
        self.model = model
        self.pins = pins
        self._best: dict = {}
        self._front: dict = {}
        self._sides: dict = {}

    def _strategies(self, task: DeviceTask, size: int) -> list[ParallelStrategy]:
        pin = self.pins.get(task.node)
        return ([pin] if pin.world_size == size else []) if pin else self.model.strategies(task, size)

    def _options(self, task: DeviceTask, size: int, shared: bool) -> list[NodeCost]:
        return [c for c in (self.model.cost(task, s, shared) for s in self._strategies(task, size)) if c.fits]

    def best(self, task: DeviceTask, size: int, shared: bool) -> NodeCost | None:
        """Fastest fitting cost of a training-side node (ties: strategy string). Strategies
        are costed in the order of ``CostModel.time_floor`` (a lower bound on their seconds)
        until the bound exceeds the best found: exact, and most are never costed."""
        key = (task.node, size, shared)
        if key not in self._best:
            tied = self.tied([task], size, shared)
            self._best[key] = tied[0] if tied else None
        return self._best[key]

    def tied(self, tasks: list[DeviceTask], size: int, shared: bool) -> list[NodeCost] | None:
        """The costs of ``tasks`` under the one strategy (on ``size`` devices) that they all
        allow and that fits each, of least summed seconds (ties: strategy string), or None.
        Costed in the order of the summed ``CostModel.time_floor`` until it exceeds the best
        sum found: exact, and most are never costed."""
        allowed = [set(self._strategies(t, size)) for t in tasks[1:]]
        common = [s for s in self._strategies(tasks[0], size) if all(s in a for a in allowed)]
        ranked = sorted(((sum(self.model.time_floor(t, s) for t in tasks), s) for s in common), key=lambda x: x[0])
        best, best_s = None, float("inf")
        for floor, s in ranked:
            if best is not None and floor > best_s:
                break
            costs = [self.model.cost(t, s, shared) for t in tasks]
            total = sum(c.time_s for c in costs)
            if all(c.fits for c in costs) and (best is None or total < best_s or
                                               (total == best_s and s.short() < best[0].strategy.short())):
                best, best_s = costs, total
        return best

    def training_side(self, tasks: list[DeviceTask], size: int, shared: bool) -> dict[str, NodeCost] | None:
        """Node -> cost of the training-side ``tasks`` of one mesh of ``size`` devices, or None
        when one has no fitting strategy. Each takes its fastest (:meth:`best`), except that
        the policy's train_step and every critic's (``DeviceTask.critic``) take one strategy
        together (:meth:`tied`): on several devices a critic runs on the policy trainer's
        ranks with its strategy (``compiler.hosting``'s ``critic-ranks``); on a mesh without
        the policy's train_step (``compiler.search``'s split layouts) a critic takes its own
        fastest strategy, as ``runtime.trainer_ranks`` runs it on ranks of its own. Exact for
        the objective: it grows with the sum of their seconds, and nothing else depends on
        their strategies.
        """
        key = (tuple(t.node for t in tasks), size, shared)
        if key not in self._sides:
            policy = [t for t in tasks if t.node == self.model.workload.aliases.get("train")]
            critics = [t for t in tasks if t.critic]
            costs: dict[str, NodeCost] | None = {}
            for t in tasks:
                if policy and critics and (t in critics or t in policy):
                    continue
                cost = self.best(t, size, shared)
                if cost is None:
                    costs = None
                    break
                costs[t.node] = cost
            if costs is not None and policy and critics:
                tied = self.tied(policy + critics, size, shared)
                costs = None if tied is None else {**costs, **{t.node: c for t, c in zip(policy + critics, tied)}}
            self._sides[key] = costs
        return self._sides[key]

    def fastest(self, task: DeviceTask, size: int, shared: bool, extra=None) -> float | None:
        """Least ``seconds + extra(strategy)`` over a generation node's fitting strategies
        (None if none fits), costed in the order of ``CostModel.generation_floor`` until the
        floor exceeds the best: exact, without costing most of them."""
        extra = extra or (lambda st: 0.0)
        ranked = sorted(((self.model.generation_floor(task, st) + extra(st), st) for st in self._strategies(task, size)),
                        key=lambda x: x[0])
        best = None
        for floor, st in ranked:
            if best is not None and floor > best:
                break
            c = self.model.cost(task, st, shared)
            if c.fits:
                best = c.time_s + extra(st) if best is None else min(best, c.time_s + extra(st))
        return best

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
