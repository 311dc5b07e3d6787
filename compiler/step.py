"""Steady-state seconds per training step of one complete allocation.

Owns the objective the search minimizes and its explanation: an allocation is a list of
*groups* (nodes that time-share one mesh), each group on its own mesh.

- generation time G = the longest group's sum of generation-node seconds; training time
  T = the longest group's sum of training/inference-node seconds (a node on a shared mesh
  includes its offload/reload swap);
- weight sync S = the sum of the routes' seconds (trainer of model M -> generator of M);
- async with staleness k >= 1 and no group holding both generation and training nodes:
  generation of step i+1 overlaps training of step i (AReaL, Fu et al. 2025), so the step
  takes ``max(G, T) + S``; otherwise (sync mode, k = 0, or colocated) ``G + T + S``;
- idle fraction = 1 - busy device-seconds / (cluster devices x step time).
"""

from __future__ import annotations

from dataclasses import dataclass

from compiler.cost import CostModel, NodeCost
from compiler.mesh import MeshSpec
from compiler.plan import SyncRoute
from compiler.strategy import ParallelStrategy
from compiler.workload import GENERATION, TRAINING, DeviceTask, Workload


@dataclass(frozen=True)
class Assignment:
    """A device node with its mesh and cost."""

    task: DeviceTask
    mesh: MeshSpec
    cost: NodeCost


@dataclass(frozen=True)
class Candidate:
    """One evaluated allocation."""

    allocation: str
    groups: tuple[tuple[Assignment, ...], ...]
    routes: tuple[SyncRoute, ...]
    generation_s: float
    training_s: float
    sync_s: float
    step_time_s: float
    idle_fraction: float
    overlapped: bool

    @property
    def fits(self) -> bool:
        return all(a.cost.fits for group in self.groups for a in group)

    @property
    def colocated(self) -> bool:
        return any(len({a.task.role == GENERATION for a in g}) > 1 for g in self.groups)

    def assignments(self) -> list[Assignment]:
        return [a for group in self.groups for a in group]


def step_time(generation_s: float, training_s: float, sync_s: float, overlapped: bool) -> float:
    """The objective: ``max(G, T) + S`` when overlapped, else ``G + T + S`` (seconds)."""
    return (max(generation_s, training_s) if overlapped else generation_s + training_s) + sync_s


def allocation_string(workload: Workload, groups: list[list[tuple[DeviceTask, ParallelStrategy]]]) -> str:
    """``gen:d4t2 + train:d2t2p2``: groups joined by ``+``, time-sharing nodes by ``|``."""
    return " + ".join(
        " | ".join(f"{workload.display_name(task.node)}:{s.short()}" for task, s in group) for group in groups
    )


def same_machine(a: MeshSpec, b: MeshSpec) -> bool:
    """Both meshes lie inside one and the same machine."""
    return a.n_nodes == 1 and b.n_nodes == 1 and a.first_node == b.first_node


def evaluate(
    model: CostModel, groups: list[list[tuple[DeviceTask, ParallelStrategy]]], meshes: list[MeshSpec]
) -> Candidate:
    """Cost a complete allocation (every device node in exactly one group).

    Args:
        groups: per group, its nodes with their strategies (world size = the mesh size).
        meshes: one mesh per group.
    """
    placed = []
    for group, mesh in zip(groups, meshes):
        shared = len(group) > 1
        placed.append(tuple(Assignment(task, mesh, model.cost(task, s, shared)) for task, s in group))
    gen = max(sum(a.cost.time_s for a in g if a.task.role == GENERATION) for g in placed)
    train = max(sum(a.cost.time_s for a in g if a.task.role != GENERATION) for g in placed)
    mixed = any(len({a.task.role == GENERATION for a in g}) > 1 for g in placed)
    overlapped = model.workload.staleness >= 1 and not mixed
    trainers = {a.task.model_name: a for g in placed for a in g if a.task.role == TRAINING}
    routes = []
    for a in (a for g in placed for a in g if a.task.role == GENERATION):
        src = trainers.get(a.task.model_name)
        if src is None:
            continue
        seconds, nbytes, link = model.sync(src.task, a.cost.strategy, src.mesh.size, same_machine(src.mesh, a.mesh))
        replicas = a.cost.strategy.dp
        routes.append(SyncRoute(src.task.node, a.task.node, src.mesh, a.mesh, nbytes, replicas, link, seconds))
    sync = sum(r.seconds for r in routes)
    step = step_time(gen, train, sync, overlapped)
    busy = sum(g[0].mesh.size * sum(a.cost.time_s for a in g) for g in placed)
    idle = 1 - busy / (model.total_devices * step) if step > 0 else 0.0
    return Candidate(
        allocation=allocation_string(model.workload, groups),
        groups=tuple(placed),
        routes=tuple(routes),
        generation_s=gen,
        training_s=train,
        sync_s=sync,
        step_time_s=step,
        idle_fraction=idle,
        overlapped=overlapped,
    )
