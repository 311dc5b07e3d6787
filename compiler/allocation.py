"""The allocation string: a manual placement of every device node, and its parser.

Grammar (whitespace between tokens is ignored)::

    allocation := group ( "+" group )*
    group      := item ( "|" item )*
    item       := name ":" strategy
    name       := [A-Za-z_][A-Za-z0-9_.-]*      a graph node, or the alias gen / train
    strategy   := ( letter number )+            letters d t p c e = DP TP PP CP EP degrees

Groups joined by ``+`` get disjoint device meshes, placed in the order written, each on
the first free aligned block (see ``compiler.mesh``). Items joined by ``|`` time-share one
mesh, so their world sizes ``d*t*p*c`` must be equal. Every node that needs devices
appears exactly once, except forward-only (inference) nodes, which default to the mesh of
their model's trainer, else the policy trainer's; CPU-light nodes are placed with their
consumer automatically. Any node may have a mesh of its own (``gen:d1 + train:d1 +
critic_step:d1``) within the runtime's shape, ``compiler.hosting``, which is checked here.
``gen`` is the generate node and ``train`` the policy's train_step.

Examples: ``gen:d4t2 + train:d2t2p2`` (8 GPUs for generation, 8 for training);
``gen:d8 | train:d8`` (generation and training time-share 8 GPUs).

Errors (:class:`AllocationError`) quote the string with a caret under the culprit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from compiler.cost import CostModel
from compiler.hosting import hosting_problem, ray_hosting_problem, workload_hosting
from compiler.mesh import MeshError, MeshSpec, fitting_clusters, pack
from compiler.strategy import ParallelStrategy, StrategyError
from compiler.workload import INFERENCE, TRAINING, DeviceTask

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_STRATEGY = re.compile(r"[A-Za-z0-9]+")
_DEGREE = re.compile(r"([dtpce])(\d+)")


class AllocationError(ValueError):
    """A bad allocation string; the message shows it with a caret at the culprit.

    Attributes:
        position: 0-based index of the offending character.
    """

    def __init__(self, text: str, position: int, reason: str):
        self.position = position
        super().__init__(f"bad allocation at character {position + 1}: {reason}\n  {text}\n  {' ' * position}^")


@dataclass(frozen=True)
class Item:
    """``name:strategy`` with the positions of both in the string (0-based)."""

    name: str
    strategy: ParallelStrategy
    name_pos: int
    strategy_pos: int


def parse(text: str) -> list[list[Item]]:
    """Parse ``text`` into groups of items (syntax only; names are not resolved).

    Raises:
        AllocationError: at the first character that breaks the grammar.
    """
    groups: list[list[Item]] = [[]]
    pos = _skip(text, 0)
    while True:
        match = _NAME.match(text, pos)
        if match is None:
            raise AllocationError(text, pos, "expected a node name")
        name, name_pos = match.group(), pos
        pos = _skip(text, match.end())
        if pos >= len(text) or text[pos] != ":":
            raise AllocationError(text, pos, f"expected ':' after node name '{name}'")
        pos = _skip(text, pos + 1)
        groups[-1].append(Item(name, _strategy(text, pos), name_pos, pos))
        pos = _skip(text, pos + len(_STRATEGY.match(text, pos).group()))
        if pos >= len(text):
            return groups
        if text[pos] == "+":
            groups.append([])
        elif text[pos] != "|":
            raise AllocationError(text, pos, "expected '+' (next mesh) or '|' (same mesh) between items")
        pos = _skip(text, pos + 1)


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _strategy(text: str, pos: int) -> ParallelStrategy:
    match = _STRATEGY.match(text, pos)
    if match is None:
        raise AllocationError(text, pos, "expected a strategy such as 'd4t2'")
    token, at, seen = match.group(), 0, set()
    while at < len(token):
        degree = _DEGREE.match(token, at)
        if degree is None:
            raise AllocationError(text, pos + at, "expected one of d/t/p/c/e followed by a number")
        if degree.group(1) in seen:
            raise AllocationError(text, pos + at, f"degree '{degree.group(1)}' given twice")
        seen.add(degree.group(1))
        at = degree.end()
    try:
        return ParallelStrategy.parse(token)
    except StrategyError as err:
        raise AllocationError(text, pos, str(err).splitlines()[0]) from None


def _place_inference(groups: list, seen: dict, workload) -> None:
    """Forward-only (``inference``) nodes the string leaves out time-share a mesh (``|``),
    data-parallel over it: the mesh of the node that trains their model when the string
    places one (a critic's advantage with ``critic_step``: current values, ReaLHF-style),
    else the policy train_step's (a reference or reward model sits with the trainer, as in
    verl). Naming them in the string places them elsewhere."""
    trains = {t.model_name: t.node for t in workload.tasks if t.role == TRAINING}

    def home_of(node: str):
        return next((g for g in groups if any(task.node == node for task, _ in g)), None)

    for task in workload.tasks:
        if task.role == INFERENCE and task.node not in seen:
            home = home_of(trains.get(task.model_name)) or home_of(workload.aliases.get("train"))
            if home is None:
                continue
            home.append((task, ParallelStrategy(dp=home[0][1].world_size)))
            seen[task.node] = None


def _check_hosting(text: str, groups: list, seen: dict, workload, meshes: list | None = None) -> None:
    """Raise AllocationError when the runtime cannot run this placement (``compiler.hosting``;
    with ``meshes``, the groups' meshes, only its rule for Ray, ``ray-one-machine``)."""
    label = {task.node: i for i, group in enumerate(groups) for task, _ in group}
    chosen = {task.node: s for group in groups for task, s in group}
    hosted = workload_hosting(workload, label, chosen)
    if meshes is None:
        problem = hosting_problem(hosted)
    else:
        problem = ray_hosting_problem(hosted, {task.node: m for group, m in zip(groups, meshes) for task, _ in group})
    if problem is not None:
        node, reason = problem
        item = seen.get(node)
        raise AllocationError(text, item.name_pos if item is not None else 0, f"node '{node}': {reason}")


def resolve(
    text: str, model: CostModel
) -> tuple[list[list[tuple[DeviceTask, ParallelStrategy]]], list[MeshSpec]]:
    """Parse ``text`` and bind it to the workload's device nodes and the cluster.

    Returns:
        ``(groups, meshes)`` ready for ``compiler.step.evaluate``.

    Raises:
        AllocationError: unknown or repeated node, a missing device node, unequal world
            sizes in one group, a strategy invalid for the node's model, a placement the
            runtime cannot run (``compiler.hosting``: the node and the rule; on Ray also
            ``ray-one-machine``), or meshes that do not fit the cluster.
    """
    workload = model.workload
    groups, seen = [], {}
    for items in parse(text):
        group = []
        for item in items:
            node = workload.resolve_name(item.name)
            if node is None:
                known = ", ".join(t.node for t in workload.tasks) + ", " + ", ".join(workload.aliases)
                raise AllocationError(text, item.name_pos, f"'{item.name}' is not a device node (known: {known})")
            if node in seen:
                raise AllocationError(text, item.name_pos, f"node '{node}' placed twice")
            seen[node] = item
            size = items[0].strategy.world_size
            if item.strategy.world_size != size:
                raise AllocationError(
                    text, item.strategy_pos,
                    f"'{item.name}' uses {item.strategy.world_size} devices but shares a mesh of {size} ('|')",
                )
            task = workload.task(node)
            try:
                model.check(task, item.strategy, size)
            except StrategyError as err:
                raise AllocationError(text, item.strategy_pos, str(err)) from None
            group.append((task, item.strategy))
        groups.append(group)
    _place_inference(groups, seen, workload)
    missing = [t.node for t in workload.tasks if t.node not in seen]
    if missing:
        raise AllocationError(text, len(text), f"device node(s) not placed: {', '.join(missing)}")
    _check_hosting(text, groups, seen, workload)
    sizes = [group[0][1].world_size for group in groups]
    try:
        meshes = pack(sizes, model.cluster.n_nodes, model.per_node)
    except MeshError as err:
        per_node, nodes = fitting_clusters(sizes, model.cluster.n_nodes, model.per_node)
        fixes = [f"cluster.n_gpus_per_node={per_node}" if per_node else "",
                 f"cluster.n_nodes={nodes}" if nodes else ""]
        fix = " or ".join(f for f in fixes if f)
        raise AllocationError(text, 0, f"{err}; it fits {fix}" if fix else str(err)) from None
    if model.scheduler == "ray":
        _check_hosting(text, groups, seen, workload, meshes)
    return groups, meshes
