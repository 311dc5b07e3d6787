"""The graph IR: nodes with typed ports, data and weight edges, and their validation.

Owns the intermediate representation between the DSL (``areal_flow.dsl``) and the
compiler: a :class:`Graph` held in a ``networkx.MultiDiGraph``. It must not know how a
node runs (``areal_flow.ops``) nor where (``compiler``).

An edge goes from a producer's output port to a consumer's input port and is either a
``data`` edge (experience: trajectories, rewards, advantages) or a ``weights`` edge (the
weight channel). A data edge into a ``train_step`` carries ``max_staleness`` = k: a sample
is trained at most k policy versions after the version that generated it. k is an int >= 0
(:func:`staleness_problem`, the one rule the IR and a plan read from disk share); its one
default, :data:`DEFAULT_MAX_STALENESS`, is ``ops.train_step``'s and ``async.max_staleness``'s.

Validation (:meth:`Graph.validate`) raises one :class:`GraphError` per defect, naming
the node, the port and the line of the graph file that created the node:
unknown op, missing producer, port type mismatch, two trainers (nodes of an op that
``trains``, e.g. ``train_step``) updating one model, a cycle with neither a weight edge nor a staleness >= 1 in it (a deadlock:
every node on it waits for the others), ``sync_weights`` whose target is not a
``generate`` of the same model; then the RL rules of ``areal_flow.graph_rules``: an
algorithm, its advantage estimator and the critic/reference model they need must agree,
and a generator of a trained model receives its weights from exactly one ``sync_weights``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Iterator

import networkx as nx

from areal_flow.graph_rules import training_defects, weight_channel_defects

DATA = "data"
WEIGHTS = "weights"

DEFAULT_MAX_STALENESS = 2
"""k when neither the graph nor the config says: AReaL's asynchronous setting (generation
runs up to two versions ahead of training); 0 is the synchronous baseline."""


def staleness_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a staleness bound k (``must be an int >= 0, got ...``),
    or None when it is one."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return None
    return f"max_staleness must be an int >= 0, got {value!r}"


class GraphError(ValueError):
    """A defect in a traced graph; the message names the node, port and source line."""


@dataclass(frozen=True)
class PortSpec:
    """One port of an op: its name, the type of value it carries, whether it must be connected."""

    name: str
    type: str
    required: bool = True

    @property
    def kind(self) -> str:
        return WEIGHTS if self.type == "weights" else DATA


@dataclass(frozen=True)
class OpSpec:
    """The schema of a node kind: its input and output ports, whether it needs a model and
    whether it ``trains`` it (a node of it updates its model: the model's one trainer, whose
    ``weights`` output ``sync_weights`` routes to the model's generator)."""

    name: str
    inputs: tuple[PortSpec, ...]
    outputs: tuple[PortSpec, ...]
    needs_model: bool = False
    trains: bool = False

    def input(self, port: str) -> PortSpec | None:
        return next((p for p in self.inputs if p.name == port), None)

    def output(self, port: str) -> PortSpec | None:
        return next((p for p in self.outputs if p.name == port), None)


@dataclass(frozen=True)
class ModelRef:
    """A model the graph reads or updates.

    Attributes:
        name: graph-level name (``"policy"``, ``"critic"``, ``"ref"``).
        spec: preset name, HF folder, GGUF file, ``config.json`` path or hub id.
        trainable: whether some ``train_step`` may update it.
    """

    name: str
    spec: str
    trainable: bool = True


@dataclass
class Node:
    """One node of the graph: an op applied to inputs, optionally reading/updating a model."""

    name: str
    op: str
    model: str | None = None
    attrs: dict = field(default_factory=dict)
    source: str = "<unknown>"  # "file.py:line" of the DSL call that created it

    def where(self) -> str:
        return f"node '{self.name}' ({self.op}, {self.source})"


@dataclass(frozen=True)
class Edge:
    """Producer port -> consumer port; ``kind`` is ``data`` or ``weights``."""

    src: str
    src_port: str
    dst: str
    dst_port: str
    kind: str = DATA
    max_staleness: int | None = None


class Graph:
    """A traced algorithm graph.

    Attributes:
        name: the ``@flow`` function's name.
        nodes: name -> :class:`Node`, in insertion (trace) order.
        edges: list of :class:`Edge`.
        models: name -> :class:`ModelRef`.
        outputs: the handles' ``(node, port)`` the flow returned.
        nx: the ``networkx.MultiDiGraph`` view (nodes carry ``node=``, edges ``edge=``).
    """

    def __init__(self, name: str, op_specs: dict[str, OpSpec]):
        self.name = name
        self.op_specs = op_specs
        self.nodes: dict[str, Node] = {}
        self.edges: list[Edge] = []
        self.models: dict[str, ModelRef] = {}
        self.outputs: list[tuple[str, str]] = []
        self.nx = nx.MultiDiGraph()

    # -- building -------------------------------------------------------------------
    def add_model(self, ref: ModelRef) -> None:
        known = self.models.get(ref.name)
        if known is not None and known.spec != ref.spec:
            raise GraphError(f"model '{ref.name}' declared twice with different specs: {known.spec!r} vs {ref.spec!r}")
        self.models[ref.name] = ref

    def add_node(self, node: Node) -> Node:
        if node.name in self.nodes:
            raise GraphError(f"two nodes named '{node.name}' ({self.nodes[node.name].source} and {node.source})")
        self.nodes[node.name] = node
        self.nx.add_node(node.name, node=node)
        return node

    def add_edge(self, edge: Edge) -> Edge:
        self.edges.append(edge)
        self.nx.add_edge(edge.src, edge.dst, key=f"{edge.src_port}->{edge.dst_port}", edge=edge)
        return edge

    def unique_name(self, base: str) -> str:
        if base not in self.nodes:
            return base
        i = 1
        while f"{base}_{i}" in self.nodes:
            i += 1
        return f"{base}_{i}"

    # -- queries --------------------------------------------------------------------
    def in_edges(self, node: str) -> list[Edge]:
        return [e for e in self.edges if e.dst == node]

    def out_edges(self, node: str) -> list[Edge]:
        return [e for e in self.edges if e.src == node]

    def nodes_of(self, op: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.op == op]

    def trainers(self) -> list[Node]:
        """The nodes that update their model (their op ``trains``: ``train_step`` or a user op
        registered with role ``training``), in trace order."""
        return [n for n in self.nodes.values() if n.op in self.op_specs and self.op_specs[n.op].trains]

    def data_producer(self, node: str) -> Node | None:
        """The producer of ``node``'s data input when it has exactly one (a trainer's batch), else None."""
        edges = [e for e in self.in_edges(node) if e.kind == DATA]
        return self.nodes.get(edges[0].src) if len(edges) == 1 else None

    def generators(self) -> list[Node]:
        """The nodes that sample with a policy: those whose op takes a ``weights`` input
        (``generate``, ``rollout``), the targets of ``sync_weights``."""
        return [n for n in self.nodes.values() if self._takes_weights(n.op)]

    def _takes_weights(self, op: str) -> bool:
        spec = self.op_specs.get(op)
        return op == "generate" if spec is None else spec.input("weights") is not None

    def producer(self, node: str, port: str) -> Node:
        """The node feeding ``node``'s input ``port``. Raises GraphError if unconnected."""
        for e in self.in_edges(node):
            if e.dst_port == port:
                return self.nodes[e.src]
        raise GraphError(f"{self.nodes[node].where()}: input port '{port}' has no producer")

    def source_of(self, node: str, port_type: str, op: str) -> Node | None:
        """The nearest node of ``op`` whose output reaches ``node`` through input ports of
        ``port_type`` (directly, or through nodes in between, e.g. user ops); None if none."""
        seen = set()
        while node not in seen:
            seen.add(node)
            spec = self.op_specs.get(self.nodes[node].op)
            feeding = [e for e in self.in_edges(node) if e.kind == DATA and spec is not None
                       and spec.input(e.dst_port) is not None and spec.input(e.dst_port).type == port_type]
            if not feeding:
                return None
            node = feeding[0].src
            if node not in self.nodes:
                return None
            if self.nodes[node].op == op:
                return self.nodes[node]
        return None

    def topological_order(self) -> list[str]:
        """Node names in data order (weight edges ignored: they close the RL loop)."""
        data = nx.DiGraph()
        data.add_nodes_from(self.nodes)
        data.add_edges_from((e.src, e.dst) for e in self.edges if e.kind == DATA)
        return list(nx.lexicographical_topological_sort(data, key=list(self.nodes).index))

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    # -- validation -----------------------------------------------------------------
    def validate(self) -> "Graph":
        """Check every rule of the module docstring; returns self. Raises GraphError."""
        for node in self.nodes.values():
            self._check_node(node)
        self._check_sync_targets()
        for edge in self.edges:
            self._check_edge(edge)
        self._check_writers()
        self._check_cycles()
        defect = next(chain(training_defects(self), weight_channel_defects(self)), None)
        if defect is not None:
            raise GraphError(defect)
        return self

    def _check_node(self, node: Node) -> None:
        spec = self.op_specs.get(node.op)
        if spec is None:
            raise GraphError(f"{node.where()}: unknown op '{node.op}'; known ops: {', '.join(sorted(self.op_specs))}")
        if spec.needs_model and node.model is None:
            raise GraphError(f"{node.where()}: op '{node.op}' needs a model")
        if node.model is not None and node.model not in self.models:
            raise GraphError(f"{node.where()}: unknown model '{node.model}'; declared: {', '.join(self.models) or 'none'}")
        connected = {e.dst_port for e in self.in_edges(node.name)}
        for port in spec.inputs:
            if port.required and port.name not in connected:
                raise GraphError(f"{node.where()}: input port '{port.name}' ({port.type}) has no producer")

    def _check_edge(self, edge: Edge) -> None:
        for end in (edge.src, edge.dst):
            if end not in self.nodes:
                raise GraphError(f"edge {edge.src}.{edge.src_port} -> {edge.dst}.{edge.dst_port}: missing node '{end}'")
        src, dst = self.nodes[edge.src], self.nodes[edge.dst]
        out_port = self.op_specs[src.op].output(edge.src_port)
        in_port = self.op_specs[dst.op].input(edge.dst_port)
        if out_port is None:
            raise GraphError(f"{src.where()}: no output port '{edge.src_port}'")
        if in_port is None:
            raise GraphError(f"{dst.where()}: no input port '{edge.dst_port}'")
        if out_port.type != in_port.type:
            raise GraphError(
                f"{dst.where()}: input port '{edge.dst_port}' expects {in_port.type}, "
                f"but '{src.name}.{edge.src_port}' produces {out_port.type}"
            )
        problem = None if edge.max_staleness is None else staleness_problem(edge.max_staleness)
        if problem:
            raise GraphError(f"{dst.where()}: port '{edge.dst_port}': {problem}")

    def _check_writers(self) -> None:
        writers: dict[str, Node] = {}
        for node in self.trainers():
            if node.model in writers:
                raise GraphError(
                    f"{node.where()}: model '{node.model}' is already updated by {writers[node.model].where()}; "
                    "one model has exactly one trainer (train_step)"
                )
            writers[node.model] = node
            if not self.models[node.model].trainable:
                raise GraphError(f"{node.where()}: model '{node.model}' is declared trainable=False")

    def _check_cycles(self) -> None:
        for cycle in nx.simple_cycles(nx.DiGraph(self.nx)):
            pairs = set(zip(cycle, cycle[1:] + cycle[:1]))
            on_cycle = [e for e in self.edges if (e.src, e.dst) in pairs]
            if not any(e.kind == WEIGHTS or (e.max_staleness or 0) >= 1 for e in on_cycle):
                path = " -> ".join(cycle + cycle[:1])
                raise GraphError(
                    f"cycle {path} has no weights edge and no staleness >= 1: every node on it waits "
                    f"for another (deadlock); first node: {self.nodes[cycle[0]].where()}"
                )

    def _check_sync_targets(self) -> None:
        for node in self.nodes_of("sync_weights"):
            for e in self.out_edges(node.name):
                target = self.nodes.get(e.dst)
                if target is None:
                    continue  # reported as a missing node by the edge check
                if not self._takes_weights(target.op) or target.model != node.model:
                    what = f"of model '{target.model}'" if target.model else "with no model"
                    raise GraphError(
                        f"{node.where()}: target {target.where()} must be a generate or rollout node of model "
                        f"'{node.model}' (it is a {target.op} node {what})"
                    )

    # -- display --------------------------------------------------------------------
    def describe(self) -> str:
        """Human-readable listing: nodes (op, model, attributes, source) and edges (kind, staleness)."""
        lines = [f"graph {self.name}: {len(self.nodes)} nodes, {len(self.edges)} edges"]
        lines.append("models:")
        for m in self.models.values():
            lines.append(f"  {m.name:<10} {m.spec}{'' if m.trainable else '  (frozen)'}")
        lines.append("nodes:")
        for name in self.topological_order():
            n = self.nodes[name]
            attrs = ", ".join(f"{k}={v!r}" for k, v in n.attrs.items())
            model = f" model={n.model}" if n.model else ""
            lines.append(f"  {n.name:<14} {n.op:<13}{model}  {attrs}  [{n.source}]")
        lines.append("edges:")
        for e in self.edges:
            stale = f"  max_staleness={e.max_staleness}" if e.max_staleness is not None else ""
            lines.append(f"  {e.src}.{e.src_port} -> {e.dst}.{e.dst_port}  [{e.kind}]{stale}")
        return "\n".join(lines)
