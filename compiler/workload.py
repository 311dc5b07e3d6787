"""What a graph asks of the devices in one training step.

Owns the reading of the graph IR for the compiler: which nodes need devices and in which
role, their models, the rollout batch (``B`` prompt groups, given by the caller, times the
group size; lengths), the staleness bound the time model assumes (k of the data edge into
the policy's train_step; a graph without one is refused, nothing is assumed), the
``gen``/``train`` aliases, and where each CPU-light node is placed. It reads only
``graph.name``, ``graph.nodes`` (``.name .op .model .attrs``), ``graph.edges``
(``.src .dst .kind .max_staleness``) and ``graph.models`` (``.name .spec .trainable``).

Roles: ``generate`` -> generation (inference engine of the model); ``train_step`` ->
training (forward + backward + optimizer); a ``reward``/``advantage`` node that reads a
model (reward model, critic values, reference log-probs) -> inference (forward only, on the
training side); the role of every op comes from its ``OpDef`` in ``areal_flow.ops.registry``.
CPU-light nodes are placed with their first device consumer (else their producer) — except
``group``-grain nodes (a rule ``reward``, ``filter``, user group ops), which run with their
last producer (the generator for a rule reward): groups are scored and filtered as they
finish, so rewards travel with the experience and DAPO's dynamic sampling acts before the
experience channel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from areal_flow.config_compile import CompileConfig, CompileConfigError
from compiler.models import ModelSpec, resolve_model

GENERATION, TRAINING, INFERENCE, CPU = "generation", "training", "inference", "cpu"


class WorkloadError(ValueError):
    """The graph lacks something the compiler needs; the message names the node/model."""


@dataclass(frozen=True)
class DeviceTask:
    """One graph node that runs on devices.

    Attributes:
        node: graph node name.
        op: graph op.
        role: generation, training or inference.
        model_name: the graph's model name.
        model: resolved model shape.
    """

    node: str
    op: str
    role: str
    model_name: str
    model: ModelSpec

    @property
    def critic(self) -> bool:
        """It trains a scalar-head (value) model: a critic's train_step (``compiler.executable``'s
        ``critic-parallel``, ``compiler.hosting``'s ``critic-ranks``)."""
        return self.role == TRAINING and self.model.head == "scalar"


@dataclass(frozen=True)
class Workload:
    """Per-step demand of a graph under a compile config.

    Attributes:
        graph_name: the graph's name.
        tasks: device nodes in graph order.
        cpu_hosts: CPU-light node -> the device node it is placed with.
        n_sequences: trajectories per step = B x samples_per_prompt.
        prompt_len: prompt tokens per trajectory (budget).
        new_tokens: response tokens per trajectory (budget).
        staleness: the k the time model assumes: the policy's edge's, 0 in sync mode.
        aliases: ``gen`` -> the generate node, ``train`` -> the policy's train_step.
        data_edges: ``(src, dst, kind, max_staleness)`` of every graph edge.
        ops: node -> op, for every graph node.
        node_attrs: device node -> its attributes (what ``compiler.executable`` reads of it).
        step_rows: the sequences a train_step takes per step when the plan runs, B x the generate
            node's ``n_samples`` (``compile.samples_per_prompt`` changes only the time model's);
            0 = ``n_sequences``.
        samples_per_prompt: trajectories per prompt group (``n_sequences / B``).
        shared_prompt_nodes: train_steps of a generator's model whose packed micro-batches run a
            group's prompt once (``train.pack_sequences`` and ``train.shared_prefix`` lowered into
            their attributes; ``areal_flow.algorithms.shared_prefix``): their time model counts
            ``prompt_len / samples_per_prompt`` prompt tokens a sequence.
    """

    graph_name: str
    tasks: tuple[DeviceTask, ...]
    cpu_hosts: dict[str, str]
    n_sequences: int
    prompt_len: int
    new_tokens: int
    staleness: int
    aliases: dict[str, str]
    data_edges: tuple[tuple[str, str, str, int | None], ...]
    ops: dict[str, str]
    node_attrs: dict[str, dict] = dataclasses.field(default_factory=dict)
    step_rows: int = 0
    samples_per_prompt: int = 1
    shared_prompt_nodes: frozenset[str] = frozenset()

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.new_tokens

    def task(self, node: str) -> DeviceTask:
        return next(t for t in self.tasks if t.node == node)

    def resolve_name(self, name: str) -> str | None:
        """Device node called ``name``, else the node the alias ``name`` stands for; None if neither."""
        for candidate in (name, self.aliases.get(name)):
            if any(t.node == candidate for t in self.tasks):
                return candidate
        return None

    def display_name(self, node: str) -> str:
        """The alias of ``node`` when it has one that no node's own name shadows, else ``node``."""
        for alias, target in self.aliases.items():
            if target == node and alias not in self.ops:
                return alias
        return node


def _role(node) -> str:
    """The node's role, from its op's cost hook in the op registry (``OpDef.role``)."""
    from areal_flow.ops.registry import lookup

    return lookup(node.op).role_of(node)


def trainers(graph) -> list:
    """The nodes of ``graph`` whose op trains its model (declared in the op registry:
    ``train_step``, a user op with role ``training``), in trace order.

    Raises:
        GraphError: a node of an unregistered op (naming the nearest one).
    """
    from areal_flow.ops.registry import lookup

    return [n for n in graph.nodes.values() if lookup(n.op).spec.trains]


def build_workload(graph, cfg: CompileConfig, batch_groups: int) -> Workload:
    """Read ``graph`` under ``cfg`` with ``batch_groups`` (B) prompt groups per train step.

    Raises:
        WorkloadError: no device node, a node's model is not declared, no data edge with k
            into the policy's train_step, or no response length.
        ModelSpecError: a model's spec cannot be resolved.
    """
    models: dict[str, ModelSpec] = {}
    scalar = scalar_head_models(graph)
    tasks = []
    for node in graph.nodes.values():
        role = _role(node)
        if role == CPU:
            continue
        ref = graph.models.get(node.model)
        if ref is None:
            raise WorkloadError(f"node '{node.name}' ({node.op}): model {node.model!r} is not declared in the graph")
        if ref.name not in models:
            spec = resolve_model(ref.spec)
            models[ref.name] = dataclasses.replace(spec, head="scalar") if ref.name in scalar else spec
        tasks.append(DeviceTask(node.name, node.op, role, ref.name, models[ref.name]))
    if not tasks:
        raise WorkloadError(f"graph '{graph.name}' has no node that needs devices (generate, train_step)")
    gens = graph.generators()
    aliases = {}
    if gens:
        aliases["gen"] = gens[0].name
        policy_train = [n for n in trainers(graph) if n.model == gens[0].model]
        if policy_train:
            aliases["train"] = policy_train[0].name
    gen_attrs = gens[0].attrs if gens else {}
    samples = cfg.samples_per_prompt or gen_attrs.get("n_samples") or 1
    # a multi-turn rollout samples up to max_turns policy turns of max_new_tokens each
    new_tokens = cfg.max_new_tokens or (gen_attrs.get("max_new_tokens") or 0) * gen_attrs.get("max_turns", 1)
    if not new_tokens:
        raise CompileConfigError("compile.max_new_tokens is null and no generate node sets max_new_tokens")
    device_nodes = {t.node for t in tasks}
    policies = {g.model for g in gens}
    shared = frozenset(n.name for n in trainers(graph) if n.model in policies and int(samples) > 1
                       and n.attrs.get("pack_sequences") and n.attrs.get("shared_prefix"))
    return Workload(
        graph_name=graph.name,
        tasks=tuple(tasks),
        cpu_hosts={n: _host(graph, n, device_nodes, tasks[0].node) for n in graph.nodes if n not in device_nodes},
        n_sequences=batch_groups * int(samples),
        prompt_len=cfg.max_prompt_len,
        new_tokens=int(new_tokens),
        staleness=0 if cfg.mode == "sync" else _edge_staleness(graph, aliases.get("train")),
        aliases=aliases,
        data_edges=tuple((e.src, e.dst, e.kind, e.max_staleness) for e in graph.edges),
        ops={n.name: n.op for n in graph.nodes.values()},
        node_attrs={t.node: dict(graph.nodes[t.node].attrs) for t in tasks},
        step_rows=batch_groups * int(gen_attrs.get("n_samples") or 1),
        samples_per_prompt=int(samples),
        shared_prompt_nodes=shared,
    )


def scalar_head_models(graph) -> dict[str, str]:
    """Models read through a scalar head: ``value`` for a critic (an advantage node's
    ``critic=``), ``reward`` for a reward model (``reward(model=)``)."""
    heads = {}
    for node in graph.nodes.values():
        if node.op == "advantage" and node.attrs.get("model_role") == "critic":
            heads[node.model] = "value"
        elif node.op == "reward" and node.model:
            heads[node.model] = "reward"
    return heads


def _edge_staleness(graph, train: str | None) -> int:
    """k of the data edge into the policy's train_step ``train`` (the IR edge is the one
    source of k; ``compile.mode=sync`` makes the time model assume 0, and
    ``compiler.program`` refuses a runnable plan whose mode and edge disagree).

    Raises:
        WorkloadError: no policy train_step, or no bound on its data edge.
    """
    for e in graph.edges:
        if e.dst == train and e.kind == "data" and e.max_staleness is not None:
            return int(e.max_staleness)
    where = f"the policy's train_step '{train}'" if train else "a train_step of the generator's model"
    raise WorkloadError(f"graph '{graph.name}': no data edge into {where} carries max_staleness (k); "
                        "ops.train_step(max_staleness=...) sets it (a user trainer op takes max_staleness= too)")


def _host(graph, name: str, device_nodes: set[str], fallback: str) -> str:
    """Where a CPU-light node runs (see the module docstring).

    A ``group``-grain node (rule reward, filter, user group ops) runs with its producers,
    as each group finishes: on the host of its producer that comes last in the graph's
    data order, so every input has arrived there. Any other node runs with its first
    device consumer (breadth-first), else its first device producer, else ``fallback``.
    """
    from areal_flow.ops.registry import GROUP, lookup

    order = {n: i for i, n in enumerate(graph.topological_order())}
    if lookup(graph.nodes[name].op).grain == GROUP:
        producers = [e.src for e in graph.edges if e.dst == name and e.kind == "data"]
        if producers:
            last = max(producers, key=order.get)
            return last if last in device_nodes else _host(graph, last, device_nodes, fallback)
    for forward in (True, False):
        seen, frontier = {name}, [name]
        while frontier:
            nxt = []
            for cur in frontier:
                for e in graph.edges:
                    near, far = (e.src, e.dst) if forward else (e.dst, e.src)
                    if near != cur or far in seen:
                        continue
                    if far in device_nodes:
                        return far
                    seen.add(far)
                    nxt.append(far)
            frontier = nxt
    return fallback
