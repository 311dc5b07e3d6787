"""Which placements of nodes on worker groups the runtime runs: one predicate, for compiler and runtime.

A *worker group* is the generate node's replicas, or one other mesh with the CPU-light nodes
placed with it (``runtime.topology``). A *step group* is a worker group that hosts ``batch``
nodes (a train_step, an advantage, any op of grain ``batch``): it runs them once per train
step. Any node may be hosted by any mesh (ReaLHF-style) under the runtime's one shape for
several step groups, a *chain*: the step groups, ordered by their first node in the graph's
data order, each take step ``s``'s whole batch — the first from the per-group channels, every
later one from the step group before it, with every value computed so far — run their batch
nodes on it and pass it on. The policy's trainer (wherever it sits in the chain) publishes
the versions; the proof of the staleness bound over a chain is ``runtime.staleness``'s. A
chain checkpoints (``train.checkpoint_every``) every step group's part at the same version and
resumes each from its own (``runtime.checkpoint``).

:func:`hosting_problem` names the first node that breaks the chain, by rule:

* ``later-group``: a node takes an input from a worker group whose first node comes after
  its own group's (the channels run forward only);
* ``batch-in-generation``: a ``batch`` node placed with the generate node's replicas (they
  run per prompt group);
* ``group-after-batch``: a ``group`` node in a step group other than the first (the batch
  reaches it whole, so no per-group call can drop or reshape a group any more);
* ``batch-to-group``: a node outside every step group takes an input from a step group
  (step groups send only to the next step group);
* ``stale-weights``: a forward-only node of a model that a node in another group trains (it
  would read the initial weights for ever; place it with the trainer, e.g. ``critic_step:d1
  | advantage:d1``); the dataset's generate node is exempt (its weights travel on the plan's
  routes);
* ``frozen-judge``: a generate node fed by a per-group node (next rule) of a model a node
  trains: its engine holds the model's initial weights and no route reaches it;
* ``one-dataset``: a second ``source`` node (dataset), or a second ``stream`` node (generate)
  fed by the dataset: the router admits the prompts of one dataset to one generator. Another
  generate node whose prompts a per-group node builds (an LLM judge, a teacher) is a
  per-group node: it runs one engine of its model in the worker group hosting it, on each
  prompt group as it arrives (``runtime.executors.fed_generate``);
* ``judge-no-route``: a weight route (``sync_weights``) reaches a generate node fed by a
  per-group node (its engine loads no weights: it runs a frozen model, without versions);
* ``judge-one-sample``: such a node samples ``n_samples != 1`` (its rollouts pair one to one
  with the samples of the group its prompts were built from);
* ``critic-ranks``: a critic's (scalar-head model's) trainer on several processes that shares
  the policy trainer's worker group but not its strategy (``runtime.parallel_critic`` runs such
  a critic on the policy train_step's ranks, e.g. ``train:d2 | critic_step:d2`` or ``train:t2 |
  critic_step:t2``). A multi-rank critic in a group without the policy's trainer spawns ranks
  of its own (``runtime.trainer_ranks``; e.g. ``critic_step:d2 | advantage:d2`` beside
  ``gen:d1 + train:d1``). Read only when
  the strategies are known (a user's allocation, a plan); the search gives a critic on several
  processes the policy trainer's mesh and strategy (``compiler.choose.NodeChoice.training_side``).

``compiler.allocation.resolve`` raises it for a user's allocation, ``compiler.search`` never
emits a candidate it refuses, and ``runtime.topology.build_topology`` raises it before any
process starts.

One more rule reads the meshes and holds only on Ray (``scheduler.type=ray``, where each
worker is one actor on one machine and a worker's processes are child processes of its actor),
:func:`ray_machine_problem`:

* ``ray-one-machine``: a worker group whose actors do not divide evenly over the machines its
  mesh spans. The dataset's generation replicas are one actor each; the policy's multi-rank
  train_step runs one actor per machine of its mesh, each spawning that machine's ranks, which
  join one ``torch.distributed`` group across the machines (``runtime.ray_scheduler``), so
  its ranks must divide evenly over the machines; every other group (a judge, a reference
  model's group, a one-rank trainer) is one actor, so its mesh must lie on one machine (e.g.
  on one-device machines ``gen:d1 + train:d2`` runs, the trainer's two ranks on two machines;
  ``gen:d1 + train:d1 + ref:d2`` is refused for the reference model).

``compiler.allocation.resolve`` and ``compiler.search`` ask it (:func:`ray_hosting_problem`)
when the plan's scheduler is Ray, and ``runtime.ray_scheduler`` before any actor starts. The
local scheduler runs every worker on one box and is not bound by it.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_flow.graph import WEIGHTS
from areal_flow.ops.registry import BATCH, GROUP, ROUTE, SOURCE, STREAM, lookup
from compiler.strategy import ParallelStrategy
from compiler.workload import GENERATION, TRAINING, Workload


@dataclass(frozen=True)
class Hosted:
    """One graph node as the predicate sees it.

    Attributes:
        name: the node. grain: its op's grain (``areal_flow.ops.registry``).
        group: the worker group hosting it (any hashable label, equal for nodes of one group).
        inputs: the nodes its data inputs come from.
        model: the model it runs (None for a CPU node). trains: it trains ``model``.
        strategy: its parallel strategy (None: a CPU node, or not chosen yet).
        critic: it trains a scalar-head (value) model. samples: a generate node's ``n_samples``.
        routed: a weight route (``sync_weights``) reaches it.
    """

    name: str
    grain: str
    group: object
    inputs: tuple[str, ...] = ()
    model: str | None = None
    trains: bool = False
    strategy: ParallelStrategy | None = None
    critic: bool = False
    samples: int = 1
    routed: bool = False


RAY_ONE_MACHINE = "ray-one-machine"


def ray_machine_problem(actors: int, mesh: str, machines: int) -> str | None:
    """Why Ray cannot place a worker group of ``actors`` actors (the dataset's generation
    replicas; the ranks of the policy's multi-rank train_step, one actor per machine holding
    that machine's ranks; else 1) on mesh ``mesh`` spanning ``machines`` machines, or None:
    the actors are spread evenly over the mesh's machines and each actor's processes run on
    its own machine (module doc, rule ``ray-one-machine``)."""
    if actors % machines == 0:
        return None
    return (f"{RAY_ONE_MACHINE}: its mesh {mesh} spans {machines} machines but runs as {actors} actor(s) on Ray; a "
            "worker's processes run on its actor's machine, and only a multi-rank policy train_step spreads its "
            "ranks over machines (evenly): give it devices of one machine (compile.allocation), or use "
            "scheduler.type=local")


def ray_hosting_problem(nodes: list[Hosted], meshes: dict) -> tuple[str, str] | None:
    """``(node, reason)`` for the first device node (data order) whose worker group breaks
    ``ray-one-machine`` (:func:`ray_machine_problem`), or None.

    Args:
        nodes: every node of the graph (:func:`workload_hosting`).
        meshes: device node -> its mesh (a ``compiler.mesh.MeshSpec``); a dataset-fed generate
            node without a strategy yet (its replica count unknown) is skipped.
    """
    fed = set(_dataset_fed(nodes))
    policies = {n.model for n in nodes if n.name in fed}
    ranks = {n.group: meshes[n.name].size for n in nodes  # a policy trainer's ranks: one per device of its mesh
             if n.trains and n.model in policies and n.name in meshes}
    for n in nodes:
        if n.name not in meshes or (n.name in fed and n.strategy is None):
            continue
        mesh = meshes[n.name]
        actors = n.strategy.dp if n.name in fed else ranks.get(n.group, 1)
        why = ray_machine_problem(actors, mesh.label(), mesh.n_nodes)
        if why is not None:
            return n.name, why
    return None


def step_groups(nodes: list[Hosted]) -> list:
    """The groups hosting ``batch`` nodes, in the order of their first node (``nodes`` is in
    data order): the chain a step's batch passes through."""
    order = _group_order(nodes)
    return sorted({n.group for n in nodes if n.grain == BATCH}, key=order.__getitem__)


def hosting_problem(nodes: list[Hosted]) -> tuple[str, str] | None:
    """``(node, reason)`` for the first node (data order) whose placement the runtime cannot
    run (module doc; ``reason`` starts with the rule's name), or None when every node's is.

    Args:
        nodes: every node of the graph, in data order; ``source`` nodes (the dataset) count
            only for ``one-dataset``, ``route`` nodes (weight syncs) are ignored.
    """
    sources = [n.name for n in nodes if n.grain == SOURCE]
    dataset_fed = _dataset_fed(nodes)
    for extra, first, what in ((sources[1:], sources[:1], "dataset"),
                               (dataset_fed[1:], dataset_fed[:1], "generate node fed by it")):
        if extra:
            return extra[0], (f"one-dataset: the runtime admits prompts from one dataset to one generate node; "
                              f"'{first[0]}' is the {what} already (a generate node fed by a per-group node, "
                              "a judge, is run per group)")
    nodes = [n for n in nodes if n.grain not in (SOURCE, ROUTE)]
    group_of = {n.name: n.group for n in nodes}
    order = _group_order(nodes)
    steps = step_groups(nodes)
    generation = {n.group for n in nodes if n.grain == STREAM}
    trainer = {n.model: n for n in nodes if n.trains}
    policy = trainer.get(next((n.model for n in nodes if n.name in dataset_fed[:1]), None))
    for n in nodes:
        here = [src for src in n.inputs if src in group_of]
        late = next((src for src in here if order[group_of[src]] > order[n.group]), None)
        if late is not None:
            return n.name, f"later-group: its input from '{late}' runs in a later worker group"
        if n.grain == BATCH and n.group in generation:
            return n.name, ("batch-in-generation: a batch node runs once per train step; the generate node's "
                            "replicas run per prompt group")
        if n.grain == GROUP and n.group in steps[1:]:
            before = _first(nodes, steps[steps.index(n.group) - 1])
            return n.name, (f"group-after-batch: a per-group node in a step group after the first (the step's batch "
                            f"reaches it whole from the step group of '{before}')")
        fed = next((src for src in here if group_of[src] in steps), None)
        if n.group not in steps and fed is not None:
            return n.name, (f"batch-to-group: its input from '{fed}' comes from a step group, which passes whole "
                            "batches only to the next step group")
        why = _judge_or_critic(n, n.grain == STREAM and n.name not in dataset_fed, policy)
        if why is not None:
            return n.name, why
        owner = trainer.get(n.model)
        if n.grain == STREAM and n.name not in dataset_fed and owner is not None:
            return n.name, (f"frozen-judge: a generate node fed by a per-group node runs a frozen model; "
                            f"'{owner.name}' trains '{n.model}' (use a model of its own, trainable=False)")
        if n.model is not None and not n.trains and n.grain != STREAM and owner is not None \
                and owner.group != n.group:
            return n.name, (f"stale-weights: it runs model '{n.model}', which '{owner.name}' trains in another worker "
                            f"group; place it with '{owner.name}' (time-share its mesh, '|')")
    return None


def _judge_or_critic(n: Hosted, judge: bool, policy: Hosted | None) -> str | None:
    """Why ``n`` breaks ``judge-no-route``, ``judge-one-sample`` (``judge``: it is a generate node
    fed by a per-group node) or ``critic-ranks`` (``policy``: the policy's trainer), or None."""
    if judge and n.routed:
        return ("judge-no-route: a generate node fed by a per-group node runs a frozen model; no weight route "
                "(sync_weights) may reach it")
    if judge and n.samples != 1:
        return (f"judge-one-sample: a generate node fed by a per-group node answers each prompt once (n_samples=1, "
                f"one response per sample of the group); got n_samples={n.samples}")
    if n.critic and n.strategy is not None and n.strategy.world_size > 1 and policy is not None \
            and policy.group == n.group and policy.strategy != n.strategy:
        return (f"critic-ranks: a critic's train_step on several processes ({n.strategy.short()}) on the policy "
                f"train_step's mesh runs on its ranks, so with its strategy ({policy.strategy.short()}; e.g. "
                "train:d2 | critic_step:d2), or on a mesh of its own (critic_step:d2 | advantage:d2)")
    return None


def workload_hosting(workload: Workload, group_of: dict[str, object],
                     strategies: dict[str, ParallelStrategy] | None = None) -> list[Hosted]:
    """The nodes of ``workload`` as :func:`hosting_problem` sees them, its device nodes in the
    groups ``group_of`` gives (device node -> label; the generate node's label is its own, as
    its replicas are a group of their own even when they time-share a mesh) and every CPU
    node in its host's; ``strategies`` (device node -> strategy) when they are chosen.

    Raises:
        KeyError: a device node ``group_of`` lacks.
    """
    tasks = {t.node: t for t in workload.tasks}
    inputs: dict[str, list[str]] = {}
    for src, dst, kind, _ in workload.data_edges:
        if kind == "data":
            inputs.setdefault(dst, []).append(src)
    routed = {dst for src, dst, kind, _ in workload.data_edges
              if kind == WEIGHTS and lookup(workload.ops[src]).grain == ROUTE}
    strategies = strategies or {}
    out = []
    for name, op in workload.ops.items():
        task = tasks.get(name)
        host = name if task is not None else workload.cpu_hosts[name]
        group = ("generation", host) if tasks[host].role == GENERATION else group_of[host]
        trains = bool(task and task.role == TRAINING)
        out.append(Hosted(name, lookup(op).grain, group, tuple(inputs.get(name, ())),
                          task.model_name if task else None, trains,
                          strategies.get(name), trains and task.model.head == "scalar",
                          int(workload.node_attrs.get(name, {}).get("n_samples") or 1), name in routed))
    return out


def _dataset_fed(nodes: list[Hosted]) -> list[str]:
    """The generate (``stream``) nodes fed by a dataset (``source``) node, in data order."""
    sources = {n.name for n in nodes if n.grain == SOURCE}
    return [n.name for n in nodes if n.grain == STREAM and set(n.inputs) & sources]


def _group_order(nodes: list[Hosted]) -> dict:
    order: dict = {}
    for n in nodes:
        order.setdefault(n.group, len(order))
    return order


def _first(nodes: list[Hosted], group) -> str:
    return next(n.name for n in nodes if n.group == group)
