"""From a plan to worker groups: which process runs which node, and how groups connect.

Owns the partition of the plan's nodes into worker groups and the checks of its shape,
made before any process starts (each error names the node); which strategies the runtime
can run is the compiler's one predicate (``compiler.executable``, asked by ``runtime.run_setup``). A worker
group is one device node's mesh with the CPU-light nodes placed with it (``placed_with``):

* the ``generation`` group of the generate node the dataset feeds: ``dp`` replicas behind
  the router (``runtime.router``); its ``group``-grain nodes (rule reward, filter, ...) run
  on each replica as groups finish;
* a generate node whose prompts a per-group node builds (:func:`judge_nodes`: an LLM judge,
  a teacher) is a per-group node of a frozen model: its own ``stage`` group (one process, one
  engine, ``runtime.executors.fed_generate``), even when it time-shares a mesh, as the
  compiler sees it (``compiler.hosting``);
* one group per other mesh (the trainer's, a critic's, a reference or reward model's own):
  it joins the groups that feed it by admission index, runs its ``group`` nodes per group
  and, if it hosts ``batch`` nodes (a *step group*), batches ``B`` groups per step in
  admission order.

Any node may be on any mesh within one shape, ``compiler.hosting`` (the predicate the
compiler uses too, checked here before any process starts, naming the node and the rule):
the step groups form a chain in data order (:attr:`Topology.step_groups`); the first joins
the per-group channels, and each passes step ``s``'s whole batch, with every value computed
so far, to the next (the channels are wired so: a later step group hears only from the one
before it, and what it reads from a per-group worker group reaches the first).

The ``dataset`` source runs on the router. Edges inside a group are calls; edges between
groups are experience channels; the plan's weight routes (``plan.routes``) go from a
trainer (a node whose role is ``training``: ``train_step``, or a user op that trains) to
every replica of its generate node. k, B and the routes are read from the plan as they are
(the plan check, ``compiler.plan_check``, has refused a plan lacking them). Which group is
*the trainer* (whose versions pace the run, which reports the step metrics and republishes
weights to a restarted replica) and the step groups whose ends end the run are one rule each,
:attr:`Topology.trainer` and :attr:`Topology.step_groups`, for every scheduler. Nothing
here reads an op's name: what a node is comes from its declared grain, role and ports
(``areal_flow.ops.registry``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_flow.ops.registry import BATCH, GENERATION, SOURCE, STREAM
from compiler.hosting import Hosted, hosting_problem
from compiler.plan import NodePlan, Plan
from compiler.strategy import ParallelStrategy, StrategyError


class TopologyError(StrategyError):
    """The plan asks for something the runtime cannot run (naming the node)."""


@dataclass
class WorkerGroup:
    """One worker group.

    Attributes:
        name: the device node it is built around.
        kind: ``generation`` or ``stage``.
        nodes: the nodes it runs, in the graph's data order.
        strategy: the device node's strategy; replicas (generation) = ``dp``, ranks of a
            multi-rank train_step = ``world_size`` (the policy's, else the first train_step's:
            a forward-only node on the mesh, e.g. the advantage reading a critic, runs on rank 0).
        upstream / downstream: names of the groups it receives from / sends to.
        batch_nodes: its ``batch``-grain nodes (a group with any is a step group).
        ranks: the processes of the policy's train_step it hosts (its world size; on Ray
            spread evenly over the mesh's machines, ``runtime.ray_scheduler``), else 1.
    """

    name: str
    kind: str
    nodes: list[str]
    strategy: ParallelStrategy
    mesh: object = None
    upstream: list[str] = field(default_factory=list)
    downstream: list[str] = field(default_factory=list)
    batch_nodes: list[str] = field(default_factory=list)
    ranks: int = 1

    @property
    def replicas(self) -> int:
        return self.strategy.dp if self.kind == GENERATION else 1


@dataclass
class Topology:
    """The worker groups of a plan and its single generate / dataset nodes.

    Attributes:
        groups: by name, generation group first.
        generate / dataset: the nodes the router and replicas run.
        train_steps: every node that trains its model (role ``training``); ``routes``:
            (trainer, generate) weight routes (``plan.routes``).
        batch_groups / max_staleness / steps: B, k (``Plan.batch_groups``, ``Plan.staleness_bound``)
            and steps.
        notes: what the runtime does differently from the plan's letter, printed at start.
    """

    groups: dict[str, WorkerGroup]
    generate: NodePlan
    dataset: NodePlan
    train_steps: list[NodePlan]
    routes: list[tuple[str, str]]
    batch_groups: int
    max_staleness: int
    steps: int
    notes: list[str] = field(default_factory=list)

    @property
    def generation(self) -> WorkerGroup:
        return self.groups[self.generate.name]

    @property
    def trainer(self) -> WorkerGroup:
        """*The* trainer, for every scheduler: the group hosting the node that trains the
        generator's model (its weights reach the replicas); when no node trains it, the first
        step group. It reports the step metrics and answers replicas' ``resync``."""
        policy = next((n.name for n in self.train_steps if n.model == self.generate.model), None)
        return next((g for g in self.groups.values() if policy in g.nodes), None) or self.step_groups[0]

    @property
    def step_groups(self) -> list[WorkerGroup]:
        """The groups hosting ``batch`` nodes, in the order a step's batch passes through them
        (``compiler.hosting``); the run ends when every one has ended (``runtime.driver``)."""
        return [g for g in self.groups.values() if g.batch_nodes]


def _host(plan: Plan, node: NodePlan) -> str:
    return node.name if node.strategy is not None else node.placed_with


def build_topology(plan: Plan) -> Topology:
    """Partition ``plan`` into worker groups and check it (module doc).

    Raises:
        TopologyError: not exactly one dataset and one generate node it feeds; a trainer
            without exactly one data input; a placement the runtime cannot run
            (``compiler.hosting``: the node and the rule, a judge's and a multi-rank
            critic's included); no trainer. (Which strategies the
            runtime can run is ``compiler.executable``'s predicate, which
            ``runtime.preflight.check_runnable`` asks before any process starts.)
    """
    _check_ops(plan)
    order = [n.name for n in plan.nodes]
    judges = judge_nodes(plan)
    gens = [n for n in plan.nodes if n.grain == STREAM and n.name not in judges]
    sources = [n for n in plan.nodes if n.grain == SOURCE]
    if len(gens) != 1 or len(sources) != 1:
        names = ", ".join(n.name for n in gens + sources)
        raise TopologyError(f"plan {plan.id}: the runtime runs one dataset and one generate node fed by it (other "
                            f"generate nodes take prompts from a per-group node), found {len(sources)} and "
                            f"{len(gens)} ({names})")
    gen, source = gens[0], sources[0]
    groups: dict[str, WorkerGroup] = {}
    meshes: dict = {}  # non-generation device nodes on one mesh share a worker group (time-share its devices)
    notes: list[str] = []
    for node in plan.nodes:
        if node.grain in (SOURCE, "route"):
            continue
        host = plan.node(_host(plan, node))
        kind = GENERATION if host.name == gen.name else "stage"
        key = host.name if kind == GENERATION or host.name in judges else meshes.setdefault(host.mesh, host.name)
        group = groups.setdefault(key, WorkerGroup(key, kind, [], host.parallel, host.mesh))
        if node.trains and node.model == gen.model:
            group.strategy = node.parallel  # the policy trainer's ranks decide the group's processes
            group.ranks = node.parallel.world_size
        elif node.trains and not any(plan.node(n).trains for n in group.nodes):
            group.strategy = node.parallel  # a critic on a mesh of its own: its ranks (runtime.trainer_ranks)
        group.nodes.append(node.name)
        if node.grain == BATCH:
            group.batch_nodes.append(node.name)
    for key, g in list(groups.items()):  # a trainer's group is named after its (first) trainer node
        step = next((n for n in g.nodes if plan.node(n).trains), None)
        if step is not None and step != key:
            g.name = step
            groups[step] = groups.pop(key)
    group_of = {n: g.name for g in groups.values() for n in g.nodes}
    problem = hosting_problem(_hosted(plan, group_of))
    if problem is not None:
        raise TopologyError(f"{plan.node(problem[0]).where()}: {problem[1]}")
    rank = {name: i for i, name in enumerate(sorted(groups, key=lambda g: order.index(groups[g].nodes[0])))}
    chain = sorted((g for g in groups if groups[g].batch_nodes), key=rank.__getitem__)
    for g in groups.values():
        for name in g.nodes:
            node = plan.node(name)
            for src, _ in node.inputs.values():
                if src == source.name or group_of[src] == g.name:
                    continue
                if g.name not in chain[1:]:
                    _connect(groups, group_of[src], g.name)
                elif group_of[src] not in chain:  # a later step group gets it with the batch from the first
                    _connect(groups, group_of[src], chain[0])
            if g.kind != GENERATION and node.strategy is not None and node.parallel.world_size > 1 \
                    and not node.trains:
                notes.append(f"{node.where()}: forward-only, per prompt group: runs on rank 0 of its mesh "
                             f"({node.strategy} in the plan)")
    for before, after in zip(chain, chain[1:]):  # the step's batch passes down the chain (compiler.hosting)
        _connect(groups, before, after)
    steps = [n for n in plan.nodes if n.trains]
    if not steps:
        raise TopologyError(f"plan {plan.id}: no node trains a model (train_step)")
    for node in steps:
        trainer_input(node)
    routes = [(r.src, r.dst) for r in plan.routes]
    return Topology(dict(sorted(groups.items(), key=lambda kv: rank[kv[0]])), gen, source, steps, routes,
                    batch_groups=plan.batch_groups, max_staleness=plan.staleness_bound,
                    steps=int(plan.run["steps"]), notes=notes)


def judge_nodes(plan: Plan) -> list[str]:
    """The generate (``stream``) nodes whose prompts come from a node other than the dataset
    (a per-group node building them from the policy's rollouts: an LLM judge, a teacher), in
    data order. Each runs per prompt group (``runtime.executors.fed_generate``)."""
    sources = {n.name for n in plan.nodes if n.grain == SOURCE}
    return [n.name for n in plan.nodes if n.grain == STREAM and n.inputs
            and not {src for src, _ in n.inputs.values()} & sources]


def _connect(groups: dict[str, WorkerGroup], src: str, dst: str) -> None:
    """A channel from group ``src`` to group ``dst`` (once)."""
    if src != dst and src not in groups[dst].upstream:
        groups[dst].upstream.append(src)
        groups[src].downstream.append(dst)


def _hosted(plan: Plan, group_of: dict[str, str]) -> list[Hosted]:
    """The plan's nodes as ``compiler.hosting`` sees them (the dataset and routes have no group)."""
    routed = {r.dst for r in plan.routes}
    return [Hosted(n.name, n.grain, group_of.get(n.name), tuple(src for src, _ in n.inputs.values()),
                   n.model if n.strategy is not None else None, n.trains, n.parallel,
                   n.trains and plan.models.get(n.model, {}).get("head", "lm") != "lm",
                   int(n.attrs.get("n_samples") or 1), n.name in routed) for n in plan.nodes]


def _check_ops(plan: Plan) -> None:
    """Every node's op is registered (built-in, or carried by the plan) and its required input
    ports are wired. Raises TopologyError naming the node."""
    from areal_flow.graph import GraphError
    from areal_flow.ops.registry import lookup
    from runtime.plan_ops import register_plan_ops

    register_plan_ops(plan)
    for node in plan.nodes:
        try:
            op = lookup(node.op)
        except GraphError as err:
            raise TopologyError(f"{node.where()}: {err}") from None
        missing = [p.name for p in op.spec.inputs if p.required and p.kind == "data" and p.name not in node.inputs]
        if missing:
            raise TopologyError(f"{node.where()}: input port(s) {', '.join(missing)} of op '{node.op}' are not wired")


def trainer_input(node: NodePlan) -> str:
    """The input port on which trainer ``node`` takes its step's batch: its one data input,
    whatever its op calls it (``advantages`` for ``train_step``).

    Raises:
        TopologyError: it has not exactly one (naming the node and its ports).
    """
    if len(node.inputs) != 1:
        raise TopologyError(f"{node.where()}: a node that trains its model takes its step's batch on one data input; "
                            f"it has {len(node.inputs)} ({', '.join(node.inputs) or 'none'})")
    return next(iter(node.inputs))
