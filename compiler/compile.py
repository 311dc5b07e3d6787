"""``compile_plan``: graph + cluster + compile config -> :class:`~compiler.plan.Plan`.

Owns the pipeline: normalize the configs, read the workload, build the cost model,
resolve pins, take the manual allocation or search, and turn the winning candidate into
a plan with a deterministic id (xxhash64 of the graph, cluster and config).
"""

from __future__ import annotations

import dataclasses
import json

import xxhash

from compiler.allocation import resolve
from areal_flow.config_compile import ClusterConfig, CompileConfig, CompileConfigError, LengthDistConfig, check_config
from compiler.cost import CostModel
from compiler.errors import InfeasiblePlanError, shortfall
from compiler.explain import component_times, plan_warnings
from compiler.hardware import device_spec
from compiler.memory import training_memory
from compiler.plan import SCHEMA_VERSION, Alternative, DataEdge, NodePlan, Plan, encode_value
from compiler.search import search
from compiler.step import Candidate, evaluate
from compiler.strategy import ParallelStrategy, StrategyError
from compiler.workload import CPU, TRAINING, Workload, build_workload, scalar_head_models, trainers


def _normalize(obj, cls):
    """A real ``cls`` dataclass from a dataclass or an OmegaConf node with the same keys."""
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)}
    if "pins" in values:
        values["pins"] = {str(k): str(v) for k, v in dict(values["pins"] or {}).items()}
    if "length_dist" in values and not isinstance(values["length_dist"], LengthDistConfig):
        values["length_dist"] = _normalize(values["length_dist"], LengthDistConfig)
    return cls(**values)


def plan_id(graph, workload: Workload, cluster: ClusterConfig, cfg: CompileConfig, batch_groups: int) -> str:
    """xxhash64 (hex) of the graph (nodes, edges, models and their resolved shapes), B, the
    cluster and the compile config."""
    payload = {
        "batch_groups": batch_groups,
        "graph": graph.name,
        "nodes": [[n.name, n.op, n.model, n.attrs] for n in graph.nodes.values()],
        "edges": [[e.src, e.src_port, e.dst, e.dst_port, e.kind, e.max_staleness] for e in graph.edges],
        "models": [[m.name, m.spec, m.trainable] for m in graph.models.values()],
        "shapes": {t.model_name: t.model.to_dict() for t in workload.tasks},
        "cluster": dataclasses.asdict(cluster),
        "compile": dataclasses.asdict(cfg),
    }
    return xxhash.xxh64(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _pins(cfg: CompileConfig, model: CostModel) -> dict[str, ParallelStrategy]:
    pins = {}
    for name, text in cfg.pins.items():
        node = model.workload.resolve_name(name)
        if node is None:
            raise CompileConfigError(f"compile.pins: '{name}' is not a device node or alias")
        try:
            strategy = ParallelStrategy.parse(text)
            model.check(model.workload.task(node), strategy, strategy.world_size)
        except StrategyError as err:
            raise CompileConfigError(f"compile.pins.{name}={text!r}: {err}") from None
        pins[node] = strategy
    return pins


def compile_plan(graph, cluster_cfg: ClusterConfig, compile_cfg: CompileConfig, *, batch_groups: int,
                 scheduler: str = "local", micro_batch_rows: int | None = None) -> Plan:
    """Place every node of ``graph`` on ``cluster_cfg`` and predict its step time.

    Args:
        graph: an ``areal_flow.graph.Graph`` (or any object with the same attributes).
        cluster_cfg: machines, devices per machine, device preset.
        compile_cfg: workload, mode and search knobs (``allocation`` skips the search).
        batch_groups: B, prompt groups per train step (``train.batch_size``); the plan
            carries it on every data edge into a train_step.
        scheduler: ``scheduler.type`` the plan runs under; ``ray`` adds the rule
            ``ray-one-machine`` (``compiler.hosting``) to the search and the allocation.
        micro_batch_rows: sequences per training micro-batch (``train.micro_batch_size``) when
            ``compile_cfg.micro_batches`` is None: each strategy's micro-batches per DP rank are
            ``ceil(sequences / dp / micro_batch_rows)``; None: the compiler chooses them.

    Returns:
        the best plan, with the other top-k allocations as ``alternatives``.

    Raises:
        CompileConfigError: a bad config value or pin (named), or ``batch_groups`` < 1.
        ModelSpecError / WorkloadError: a model or the graph cannot be read.
        AllocationError: a bad manual allocation (caret at the culprit).
        InfeasiblePlanError: nothing fits memory (per-node floors and knobs).
    """
    cluster = _normalize(cluster_cfg, ClusterConfig)
    cfg = _normalize(compile_cfg, CompileConfig)
    check_config(cluster, cfg)
    if isinstance(batch_groups, bool) or not isinstance(batch_groups, int) or batch_groups < 1:
        raise CompileConfigError(f"train.batch_size={batch_groups!r}: must be an int >= 1 (B, prompt groups per step)")
    workload = build_workload(graph, cfg, batch_groups)
    model = CostModel(workload, device_spec(cluster.gpu), cluster, cfg, scheduler, micro_batch_rows,
                      sync_dtype=wire_dtype(graph))
    pins = _pins(cfg, model)
    if cfg.allocation:
        chosen = evaluate(model, *resolve(cfg.allocation, model))
        if not chosen.fits:
            raise InfeasiblePlanError(
                f"allocation '{cfg.allocation}' does not fit {model.device.name} memory; per node:",
                [shortfall(a.task, a.cost, model.usable, cfg) for a in chosen.assignments()],
            )
        try:
            found = search(model, pins, cfg.top_k)
        except InfeasiblePlanError:
            found = []
        ranked = [chosen] + [c for c in found if c.allocation != chosen.allocation][: cfg.top_k - 1]
    else:
        found = ranked = search(model, pins, cfg.top_k)
    warnings = plan_warnings(ranked[0], found, manual=bool(cfg.allocation), asked_async=workload.staleness >= 1,
                             total_devices=model.total_devices)
    return _to_plan(ranked, graph, workload, model, cluster, cfg, warnings, batch_groups)


WIRE_BYTES_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def wire_dtype(graph) -> str | None:
    """The dtype every ``sync_weights`` node of ``graph`` sends the weights in (its
    ``weights_dtype``, lowered by ``compiler.program``) as ``compiler.memory.DTYPE_BYTES`` names
    it; None when they differ, name none, or defer to the engine (``engine``: known only once it
    starts), so the weight sync is sized by ``compile.dtype``."""
    names = {WIRE_BYTES_NAMES.get(str(n.attrs.get("weights_dtype"))) for n in graph.nodes.values()
             if n.op == "sync_weights"}
    return names.pop() if len(names) == 1 else None


def _checkpointing(a, model: CostModel, cfg: CompileConfig) -> bool:
    """Activation checkpointing for a training node: ``compile.activation_checkpointing`` true
    turns it on, false off; null (auto) turns it on only when the node's memory without it
    would not fit the device (recomputation costs ~1/3 more compute, Chen et al. 2016)."""
    if a.task.role != TRAINING or cfg.activation_checkpointing is not None:
        return a.task.role == TRAINING and bool(cfg.activation_checkpointing)
    w = model.workload
    plain = training_memory(a.task.model, a.cost.strategy, tokens_per_step=w.n_sequences * w.seq_len,
                            micro_batches=a.cost.micro_batches, dtype=cfg.dtype, sharded=cfg.optimizer_sharding,
                            checkpointing=False)
    return plain.total > model.usable


def _node_ir(graph, name: str) -> dict:
    """The graph-side fields of a plan node: attrs, input ports, output ports, grain, source and
    its op's declarations for the runtime (``multi_turn``, ``max_attempts``)."""
    from areal_flow.ops.registry import lookup

    node = graph.nodes[name]
    op = lookup(node.op)
    inputs = {e.dst_port: [e.src, e.src_port] for e in graph.edges if e.dst == name and e.kind == "data"}
    return dict(attrs=encode_value(node.attrs), inputs=inputs, outputs=tuple(p.name for p in op.spec.outputs),
                grain=op.grain, source=node.source, multi_turn=op.multi_turn, max_attempts=op.max_attempts_of(node))


def _models(graph) -> dict:
    """Model name -> spec, trainable and head: ``value`` for a critic (read by an advantage
    node as ``critic=``), ``reward`` for a reward model (``reward(model=)``), else ``lm``."""
    heads = scalar_head_models(graph)
    return {m.name: {"spec": m.spec, "trainable": m.trainable, "head": heads.get(m.name, "lm")}
            for m in graph.models.values()}


def _user_ops(graph) -> dict:
    from areal_flow.ops.registry import lookup

    ops = {lookup(n.op) for n in graph.nodes.values()}
    return {op.name: encode_value(op) for op in ops if not op.builtin}


def _edges(graph, batch_groups: int) -> tuple[DataEdge, ...]:
    steps = {n.name for n in trainers(graph)}
    return tuple(
        DataEdge(e.src, e.dst, e.kind, e.max_staleness, e.src_port, e.dst_port,
                 batch_groups if e.kind == "data" and e.dst in steps else None)
        for e in graph.edges
    )


def _to_plan(ranked: list[Candidate], graph, workload: Workload, model: CostModel, cluster, cfg,
             warnings: tuple[str, ...], batch_groups: int) -> Plan:
    best = ranked[0]
    placed = {a.task.node: a for a in best.assignments()}
    nodes = []
    for name, op in workload.ops.items():
        if name in placed:
            a = placed[name]
            nodes.append(NodePlan(
                name=name, op=op, role=a.task.role, model=a.task.model_name, mesh=a.mesh,
                strategy=a.cost.strategy.short(), memory=a.cost.memory.to_dict(), times=dict(a.cost.times),
                micro_batches=a.cost.micro_batches, concurrent=a.cost.concurrent,
                activation_checkpointing=_checkpointing(a, model, cfg), **_node_ir(graph, name),
            ))
        else:
            host = placed[workload.cpu_hosts[name]]
            nodes.append(NodePlan(
                name=name, op=op, role=CPU, model=graph.nodes[name].model, mesh=host.mesh, strategy=None,
                placed_with=host.task.node, **_node_ir(graph, name),
            ))
    cuda = cluster.gpu != "cpu"
    return Plan(
        schema_version=SCHEMA_VERSION,
        id=plan_id(graph, workload, cluster, cfg, batch_groups),
        graph=workload.graph_name,
        cluster=dataclasses.asdict(cluster),
        device=model.device.to_dict(),
        mode=cfg.mode or ("async" if workload.staleness else "sync"),
        max_staleness=workload.staleness,
        allocation=best.allocation,
        colocated=best.colocated,
        overlapped=best.overlapped,
        step_time_s=best.step_time_s,
        generation_s=best.generation_s,
        training_s=best.training_s,
        sync_s=best.sync_s,
        idle_fraction=best.idle_fraction,
        nodes=tuple(nodes),
        routes=tuple(best.routes),
        edges=_edges(graph, batch_groups),
        alternatives=tuple(Alternative(c.allocation, c.step_time_s, c.idle_fraction, c.colocated, component_times(c))
                           for c in ranked),
        models=_models(graph),
        ops=_user_ops(graph),
        device_type="cuda" if cuda else "cpu",
        backend="nccl" if cuda else "gloo",
        workload=dict(
            n_sequences=workload.n_sequences, prompt_len=workload.prompt_len, new_tokens=workload.new_tokens,
            samples_per_prompt=workload.n_sequences // batch_groups,
            length_dist=dataclasses.asdict(cfg.length_dist), mfu=cfg.mfu,
            bandwidth_efficiency=cfg.bandwidth_efficiency, dtype=cfg.dtype,
            decode_step_overhead_s=cfg.decode_step_overhead_s, memory_fraction=cfg.memory_fraction,
            fsdp_overlap=cfg.fsdp_overlap,
        ),
        warnings=warnings,
    )
