"""The compiled plan: what runs where, how fast, and why; and its JSON form (``plan.json``).

Owns the :class:`Plan` dataclasses and their versioned JSON schema. The runtime reads a
plan through :meth:`Plan.from_json` and :meth:`NodePlan.parallel`. It must not compute
placements (``compiler.compile``) nor draw them (``compiler.viz``).

The plan is the runtime's only input (``runtime.run(plan)``): besides placements and
predictions it holds every node's op, attributes and input ports (a train_step's whole
``LossConfig`` in ``attrs.loss``), the models' specs and heads, every edge with its ports,
staleness bound k and batch size B (on the data edges into train_steps, nowhere else the
runtime reads), the weight routes the trainer publishes on, the run's settings (``run``:
steps, seed, optimizer, warm start, evaluation, scheduler) and the definitions of
user-registered ops, algorithms and estimators. Values that are not JSON (a reward
function defined in the graph file, a user op, algorithm or estimator) are stored as
base64 cloudpickle (``{"__pickle__": ...}``) and restored by :func:`decode_value` on the
worker; a plan is therefore as trusted as the graph file it came from.

Schema (``schema_version`` 3): units are bytes per device for ``memory``, seconds for
every ``*_s``/``seconds``/``times`` value, and a fraction in [0, 1] for ``idle_fraction``.
A change of field meaning or name bumps ``SCHEMA_VERSION`` (3: ``attrs.loss`` is the whole
merged loss, not overrides); :meth:`Plan.from_json` refuses other versions.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from compiler.mesh import MeshError, MeshSpec
from compiler.plan_check import check_plan
from compiler.plan_types import check_json_types
from compiler.strategy import ParallelStrategy

SCHEMA_VERSION = 3


def encode_value(value: Any) -> Any:
    """A JSON-safe form of an attribute value: JSON values as they are (tuples as lists),
    anything else as ``{"__pickle__": base64 cloudpickle, "name": its name}``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [encode_value(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value) and "__pickle__" not in value:
        return {k: encode_value(v) for k, v in value.items()}
    from compiler.pickling import dumps  # code keeps its file name: a worker's traceback names the graph file

    return {"__pickle__": base64.b64encode(dumps(value)).decode(),
            "name": getattr(value, "__qualname__", type(value).__name__)}


def decode_value(value: Any) -> Any:
    """Inverse of :func:`encode_value` (unpickles: run only plans you made)."""
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if isinstance(value, dict):
        if "__pickle__" in value:
            import cloudpickle

            return cloudpickle.loads(base64.b64decode(value["__pickle__"]))
        return {k: decode_value(v) for k, v in value.items()}
    return value


class PlanSchemaError(ValueError):
    """A plan.json of another schema version, or missing a field (named)."""


_OPTIONAL = ("models", "run", "ops", "algorithms", "estimators", "device_type", "backend", "workload", "warnings")


def _node(data: dict) -> NodePlan:
    try:
        return NodePlan(**{**data, "mesh": _mesh(data["mesh"]), "outputs": tuple(data.get("outputs", ()))})
    except KeyError as err:
        raise PlanSchemaError(f"plan node '{data.get('name', '?')}' is missing field {err}") from None
    except TypeError as err:
        raise PlanSchemaError(f"plan node '{data.get('name', '?')}': {err}") from None


def _mesh(data: dict | None) -> MeshSpec | None:
    return None if data is None else MeshSpec.from_dict(data)


@dataclass(frozen=True)
class NodePlan:
    """Placement of one graph node.

    Attributes:
        name / op / model: from the graph (model None for model-less nodes).
        role: generation, training, inference or cpu (its op's declared role; ``training``:
            the node trains its model, :attr:`trains`).
        mesh: devices it runs on (for a cpu node: its host's mesh).
        strategy: compact strategy (``d4t2``); None for cpu nodes.
        placed_with: for a cpu node, the device node whose machine hosts it.
        memory: bytes per device by component (weights, gradients, optimizer, activations,
            kv_cache); empty for cpu nodes.
        times: predicted seconds per step by component.
        micro_batches: training/inference micro-batches per DP rank.
        concurrent: sequences one generation replica decodes at once.
        attrs: the node's attributes (encoded with :func:`encode_value`).
        inputs: input port -> ``[producer node, producer port]``.
        outputs: output port names.
        grain: how the runtime drives it (``areal_flow.ops.registry``).
        source: ``file:line`` of the graph file that declared it.
        activation_checkpointing: recompute activations in the backward pass (training).
        multi_turn: a generator whose rollouts are multi-turn episodes (its op's declaration).
        max_attempts: a group node that may drop its group: prompts per batch slot it allows
            (its op's declaration); None for a node that never drops one.
    """

    name: str
    op: str
    role: str
    model: str | None
    mesh: MeshSpec | None
    strategy: str | None
    placed_with: str | None = None
    memory: dict = field(default_factory=dict)
    times: dict = field(default_factory=dict)
    micro_batches: int | None = None
    concurrent: int | None = None
    attrs: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    outputs: tuple = ()
    grain: str = ""
    source: str = ""
    activation_checkpointing: bool = False
    multi_turn: bool = False
    max_attempts: int | None = None

    def where(self) -> str:
        return f"node '{self.name}' ({self.op}, {self.source})"

    @property
    def trains(self) -> bool:
        """Whether it updates its model (role ``training``): the model's one trainer, a batch node."""
        return self.role == "training"

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def time_s(self) -> float:
        return sum(self.times.values())

    @property
    def parallel(self) -> ParallelStrategy | None:
        """The strategy as the runtime's :class:`ParallelStrategy` (None for cpu nodes)."""
        return None if self.strategy is None else ParallelStrategy.parse(self.strategy)


@dataclass(frozen=True)
class SyncRoute:
    """Weight sync from train_step ``src``'s mesh to generator ``dst``'s mesh: ``bytes`` in total
    (one copy per generation replica, ``replicas`` of them), over ``link`` (intra-node/inter-node),
    seconds. The runtime publishes each new version of ``src`` to every replica of ``dst``
    exactly along the plan's routes."""

    src: str
    dst: str
    src_mesh: MeshSpec
    dst_mesh: MeshSpec
    bytes: float
    replicas: int
    link: str
    seconds: float


@dataclass(frozen=True)
class DataEdge:
    """A graph edge: ``kind`` data or weights; ``max_staleness`` (k, versions) and
    ``batch_groups`` (B, prompt groups per train step) on a data edge into a train_step:
    the one place of k and B the runtime reads (``Plan.staleness_bound``, ``Plan.batch_groups``)."""

    src: str
    dst: str
    kind: str
    max_staleness: int | None = None
    src_port: str = ""
    dst_port: str = ""
    batch_groups: int | None = None


@dataclass(frozen=True)
class Alternative:
    """One of the best allocations found (the chosen one first); ``times``: seconds of
    ``generation``, ``training``, ``sync`` and of each node's components
    (``node.component``), for ``compiler.explain``."""

    allocation: str
    step_time_s: float
    idle_fraction: float
    colocated: bool
    times: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """A compiled placement of a graph on a cluster.

    Attributes:
        schema_version: ``SCHEMA_VERSION`` of the writer.
        id: xxhash64 (hex) of the graph, cluster and compile config; equal inputs, equal id.
        graph: graph name.
        cluster: ``n_nodes``, ``n_gpus_per_node``, ``gpu``.
        device: the device preset's figures (``compiler.hardware.DeviceSpec``).
        mode: async or sync; ``max_staleness``: the k the time model assumed (0 in sync
            mode; predictions only: the runtime reads :attr:`staleness_bound`).
        allocation: the allocation string (``compiler.allocation`` grammar).
        colocated: some mesh time-shares generation and training.
        overlapped: generation overlaps training (async, k >= 1, not colocated).
        step_time_s / generation_s / training_s / sync_s: predicted seconds per step.
        idle_fraction: share of cluster device-seconds not spent in a node.
        nodes: every graph node; routes: weight syncs; edges: graph edges.
        alternatives: top-k allocations, best first.
        models: model name -> ``{"spec", "trainable", "head"}`` (head: lm, value or reward).
        run: the run's settings (``compiler.lowering.RunSpec`` as a dict).
        ops: user-registered op name -> its ``OpDef``, encoded.
        algorithms: user-registered algorithm name -> its ``BaseAlgorithm`` subclass, encoded.
        estimators: user-registered estimator name -> its ``catalog.UserEstimator``, encoded.
        device_type / backend: ``cpu``/``gloo`` or ``cuda``/``nccl``.
        workload: what the time model assumed, for ``compiler.simulate``: ``n_sequences``,
            ``prompt_len``, ``new_tokens``, ``samples_per_prompt``, ``length_dist``
            (``compile.length_dist``), ``mfu``, ``bandwidth_efficiency``, ``dtype``,
            ``decode_step_overhead_s``, ``memory_fraction``, ``fsdp_overlap``.
        warnings: the compiler's warnings (``compiler.explain.plan_warnings``): a manual
            allocation much slower than the best found, idle devices, async asked but
            generation and training colocated.
    """

    schema_version: int
    id: str
    graph: str
    cluster: dict
    device: dict
    mode: str
    max_staleness: int
    allocation: str
    colocated: bool
    overlapped: bool
    step_time_s: float
    generation_s: float
    training_s: float
    sync_s: float
    idle_fraction: float
    nodes: tuple[NodePlan, ...]
    routes: tuple[SyncRoute, ...]
    edges: tuple[DataEdge, ...]
    alternatives: tuple[Alternative, ...]
    models: dict = field(default_factory=dict)
    run: dict = field(default_factory=dict)
    ops: dict = field(default_factory=dict)
    algorithms: dict = field(default_factory=dict)
    estimators: dict = field(default_factory=dict)
    device_type: str = "cpu"
    backend: str = "gloo"
    workload: dict = field(default_factory=dict)
    warnings: tuple = ()

    def train_edges(self) -> list[DataEdge]:
        """The data edges into the trainers (nodes whose role is ``training``: ``train_step``, a
        user op that trains), in plan order (the edges that carry k and B)."""
        steps = {n.name for n in self.nodes if n.trains}
        return [e for e in self.edges if e.dst in steps and e.kind == "data"]

    @property
    def staleness_bound(self) -> int:
        """k that runs: the bound on the data edges into the train_steps (the one source of k;
        :func:`compiler.plan_check.check_plan` makes them carry one value; ``max_staleness`` is
        what the compiler's time model assumed).

        Raises:
            ValueError: no such edge carries k (a plan the plan check refuses).
        """
        return self._edge_value("max_staleness")

    @property
    def batch_groups(self) -> int:
        """B that runs: prompt groups per train step, from the data edges into the train_steps
        (as :attr:`staleness_bound`). Raises ValueError when no such edge carries B."""
        return self._edge_value("batch_groups")

    def _edge_value(self, name: str) -> int:
        for edge in self.train_edges():
            if getattr(edge, name) is not None:
                return getattr(edge, name)
        raise ValueError(f"plan {self.id}: no data edge into a train_step carries {name}")

    def node(self, name: str) -> NodePlan:
        """The node called ``name``. Raises KeyError naming it."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"plan {self.id} has no node '{name}'")

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        """Rebuild a plan. Raises PlanSchemaError for another schema version, a field of the
        wrong JSON type (``compiler.plan_types``), a missing field or a mesh that breaks the
        alignment rule on the plan's cluster."""
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanSchemaError(f"plan schema_version={version!r}; this compiler reads version {SCHEMA_VERSION}")
        check_json_types(data, {"nodes": NodePlan, "routes": SyncRoute, "edges": DataEdge, "alternatives": Alternative},
                         cls, PlanSchemaError)
        try:
            plan = cls(
                **{k: data[k] for k in cls.__dataclass_fields__
                   if k not in ("nodes", "routes", "edges", "alternatives", "warnings")
                   and (k in data or k not in _OPTIONAL)},
                warnings=tuple(data.get("warnings", ())),
                nodes=tuple(_node(n) for n in data["nodes"]),
                routes=tuple(
                    SyncRoute(**{**r, "src_mesh": _mesh(r["src_mesh"]), "dst_mesh": _mesh(r["dst_mesh"])})
                    for r in data["routes"]
                ),
                edges=tuple(DataEdge(**e) for e in data["edges"]),
                alternatives=tuple(Alternative(**a) for a in data["alternatives"]),
            )
        except KeyError as err:
            raise PlanSchemaError(f"plan is missing field {err}") from None
        except TypeError as err:
            raise PlanSchemaError(f"plan has a field this schema does not know: {err}") from None
        for node in plan.nodes:
            if node.mesh is not None:
                try:
                    node.mesh.validate(plan.cluster["n_nodes"], plan.cluster["n_gpus_per_node"])
                except MeshError as err:
                    raise PlanSchemaError(f"plan node '{node.name}': {err}") from None
        check_plan(plan, PlanSchemaError)
        return plan

    @classmethod
    def from_json(cls, text: str, source: str = "plan.json") -> "Plan":
        """Parse plan JSON ``text`` (read from ``source``, named in errors). Raises
        PlanSchemaError (also for malformed JSON)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanSchemaError(f"{source} line {err.lineno}: {err.msg}") from None
        try:
            return cls.from_dict(data)
        except PlanSchemaError as err:
            raise PlanSchemaError(f"{source}: {err}") from None
