"""Lowering a traced graph and its experiment config into the plan the runtime executes.

Owns the one place where config keys become plan fields, so that ``areal-flow compile -o
plan.json`` followed by ``areal-flow run --plan plan.json`` runs exactly what
``areal-flow run graph.py`` runs: the runtime reads the plan and nothing else
(``runtime.run``). What goes where:

* node attributes: ``generate`` gets ``max_batch_size`` (engine slots, ``gen.max_batch_size``),
  ``interruptible`` (``gen.interruptible``), ``engine_dtype`` (the embedded engine's dtype, ``gen.dtype``),
  ``engine_lm_head_dtype`` (its final norm's and LM head's, ``gen.lm_head_dtype``),
  ``engine_cpu_kernels`` (its fused CPU kernels, ``gen.cpu_kernels``), ``vllm_compile``
  (``gen.vllm_compile``: a vLLM engine compiles its model); a ``sync_weights`` gets these too and
  ``weights_dtype``, the dtype the weights travel in to its generator
  (``areal_flow.dtypes.weights_dtype`` of that generator's ``engine_dtype`` and ``model.dtype``)
  and ``reward.max_failure_fraction`` / ``failure_window`` (for its failed requests); ``rollout``
  gets the engine's four and the same failure budget (for its failed episodes);
  every trainer (``train_step``, or a user op with role ``training``) gets its optimizer
  (``train.lr``, ``lr_warmup_steps``, ``weight_decay``, ``max_grad_norm``), micro-batching
  (``max_tokens_per_micro_batch``, ``pack_sequences``), ``checkpoint_every``,
  ``max_nonfinite_steps`` and its whole loss config (``loss``: the algorithm's defaults with
  ``train.loss``, and the off-policy correction for k >= 1: ``compiler.algorithms``); a rule
  ``reward`` gets ``reward.timeout_s``, ``workers``, ``max_failure_fraction`` and
  ``failure_window`` (``areal_flow.rewards.pool``); an ``advantage`` node with
  ``estimator="multi_turn"`` in ``mode="turn"`` over an ``ops.rollout``'s episodes gets that
  rollout's ``gamma`` (a discount per turn, as the episode return's) unless it was given one;
  ``mode="token"`` discounts per policy token, another unit, so it keeps its own (1.0 unless given);
* ``compile.micro_batches`` from ``train.gradient_accumulation_steps`` when set (exactly that
  many per DP rank; each train_step's ``gradient_accumulation_steps`` attribute makes the
  compiler keep only the ``dp`` whose rows divide by it, ``compiler.executable``), else (when
  null) from ``train.micro_batch_size``: each DP rank's ``train.batch_size x n_samples / dp``
  sequences in micro-batches of at most that many (the count follows each strategy's ``dp``:
  ``compile_plan``'s ``micro_batch_rows``); the compiler writes the count per DP rank into the
  plan and the trainer follows the plan;
* ``plan.run``: :class:`RunSpec` (name, folders, seed, steps, warm start, evaluation,
  scheduler, dtype);
* ``plan.algorithms`` / ``plan.estimators``: the user-registered algorithms and estimators
  the graph names, by value.

The staleness bound k (from the graph) and the batch size B (``train.batch_size``) travel on
the data edge into each ``train_step`` (written by the compiler), nowhere else; the finished
plan passes the one plan check (``compiler.plan_check``) before anything runs or is written.
It imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math

import xxhash

from areal_flow.config import ExperimentConfig
from areal_flow.dtypes import weights_dtype, wire_dtype_name
from areal_flow.graph import Graph
from compiler.lowering import RunSpec
from compiler.workload import trainers


def lower_attrs(graph: Graph, cfg: ExperimentConfig) -> None:
    """Write the config's per-node settings into the nodes' attributes (module doc)."""
    steps = trainers(graph)
    for node in graph.nodes.values():
        if node in graph.generators():
            node.attrs.setdefault("max_batch_size", cfg.gen.max_batch_size)
            node.attrs.setdefault("engine_dtype", cfg.gen.dtype)
            node.attrs.setdefault("engine_lm_head_dtype", cfg.gen.lm_head_dtype)
            node.attrs.setdefault("engine_cpu_kernels", cfg.gen.cpu_kernels)
            node.attrs.setdefault("vllm_compile", cfg.gen.vllm_compile)
            if node.op == "generate":
                node.attrs.setdefault("interruptible", cfg.gen.interruptible)
            if node.op in ("generate", "rollout"):  # failed requests / episodes: the reward's failure fraction
                node.attrs.update(max_failure_fraction=cfg.reward.max_failure_fraction,
                                  failure_window=cfg.reward.failure_window)
        elif node in steps:
            t = cfg.train
            node.attrs.update(lr=t.lr, lr_warmup_steps=t.lr_warmup_steps, weight_decay=t.weight_decay,
                              max_grad_norm=t.max_grad_norm, checkpoint_every=t.checkpoint_every,
                              max_tokens_per_micro_batch=t.max_tokens_per_micro_batch, pack_sequences=t.pack_sequences,
                              shared_prefix=t.shared_prefix,
                              max_nonfinite_steps=t.max_nonfinite_steps,
                              gradient_accumulation_steps=t.gradient_accumulation_steps)
        elif node.op == "reward" and node.attrs.get("fn") is not None:
            r = cfg.reward
            node.attrs.update(timeout_s=r.timeout_s, workers=r.workers, max_failure_fraction=r.max_failure_fraction,
                              failure_window=r.failure_window)
        elif node.op == "advantage" and node.attrs.get("estimator") == "multi_turn" \
                and node.attrs.get("mode", "turn") == "turn":
            episodes = graph.source_of(node.name, "rollouts", "rollout")
            if episodes is not None:  # the per-turn discount of the episodes' returns
                node.attrs.setdefault("gamma", episodes.attrs["gamma"])
    for node in graph.nodes.values():  # after the loop: the generator's engine_dtype is lowered
        if node.op == "sync_weights":
            gens = [graph.nodes[e.dst].attrs for e in graph.edges if e.src == node.name]
            given, device = node.attrs.get("weights_dtype"), "cpu" if cfg.cluster.gpu.lower() == "cpu" else "cuda"
            node.attrs["weights_dtype"] = wire_dtype_name(given) if given else "float32" if not gens else \
                weights_dtype(gens[0].get("engine_dtype", cfg.gen.dtype), cfg.model.dtype,
                              engine=gens[0].get("engine", "embedded"), device=device)


def micro_batches(cfg: ExperimentConfig, graph: Graph) -> int:
    """Micro-batches per DP rank of the train_steps from ``train.gradient_accumulation_steps``.

    Raises:
        CompileConfigError: ``train.gradient_accumulation_steps`` that divides no step's rows, or
            that ``compile.micro_batches`` contradicts (naming both keys).
    """
    from areal_flow.config_compile import CompileConfigError

    gens = graph.generators()
    samples = gens[0].attrs.get("n_samples", 1) if gens else 1
    rows, steps = cfg.train.batch_size * samples, cfg.train.gradient_accumulation_steps
    if cfg.compile.micro_batches not in (None, steps):
        raise CompileConfigError(f"train.gradient_accumulation_steps={steps} and compile.micro_batches="
                                 f"{cfg.compile.micro_batches} both set the micro-batches per DP rank; keep one")
    if rows % steps:
        raise CompileConfigError(f"train.gradient_accumulation_steps={steps} does not divide the {rows} sequences of "
                                 f"a step (train.batch_size x gen.n_samples = {cfg.train.batch_size} x {samples}): "
                                 "every micro-batch holds the same number of sequences")
    return steps


def compile_program(graph: Graph, cfg: ExperimentConfig):
    """The runnable plan of ``graph`` under ``cfg`` (a :class:`compiler.plan.Plan`).

    Raises:
        the compiler's errors (``compiler.compile_plan``), each naming its culprit;
        CompileConfigError: ``train.loss`` a train_step's algorithm cannot take, or a plan the
            plan check refuses.
    """
    from compiler import compile_plan
    from compiler.algorithms import group_notes, lower_losses, user_code
    from compiler.plan_check import check_plan
    from areal_flow.config_compile import CompileConfigError

    bounds = {e.dst: e.max_staleness for e in graph.edges if e.max_staleness is not None}
    if cfg.compile.mode == "sync" and any(bounds.values()):
        step, k = next((d, k) for d, k in bounds.items() if k)
        raise CompileConfigError(f"compile.mode=sync, but the edge into '{step}' allows staleness k={k}: set k=0 on "
                                 "that edge (async.max_staleness=0 in the graphs here) for a synchronous run")
    data_edges = sorted({f"{e.src}->{e.dst}" for e in graph.edges if e.kind != "weights"})
    for edge in cfg.debug.record:
        if edge.replace(" ", "") not in data_edges:
            raise CompileConfigError(f"debug.record: {edge!r} is not a data edge of the graph; edges: "
                                     f"{', '.join(data_edges)}")
    lower_attrs(graph, cfg)
    notes = lower_losses(graph, cfg.train.loss) + group_notes(graph)
    compile_cfg = dataclasses.replace(cfg.compile)
    if cfg.train.gradient_accumulation_steps:
        compile_cfg.micro_batches = micro_batches(cfg, graph)
    plan = compile_plan(graph, cfg.cluster, compile_cfg, batch_groups=cfg.train.batch_size,
                        scheduler=cfg.scheduler.type, micro_batch_rows=cfg.train.micro_batch_size)
    run = dataclasses.asdict(RunSpec.from_config(cfg))
    algorithms, estimators = user_code(graph)
    plan_id = xxhash.xxh64(json.dumps([plan.id, run], sort_keys=True).encode()).hexdigest()
    plan = dataclasses.replace(plan, run=run, id=plan_id, algorithms=algorithms, estimators=estimators,
                               warnings=plan.warnings + notes)
    check_plan(plan, CompileConfigError)
    return plan
