"""Lowering a traced graph and its experiment config into the plan the runtime executes.

Owns the one place where config keys become plan fields, so that ``areal-flow compile -o
plan.json`` followed by ``areal-flow run --plan plan.json`` runs exactly what
``areal-flow run graph.py`` runs: the runtime reads the plan and nothing else
(``runtime.run``). What goes where:

* node attributes: ``generate`` gets ``max_batch_size`` (engine slots, ``gen.max_batch_size``),
  ``interruptible`` (``gen.interruptible``), ``engine_dtype`` (the embedded engine's dtype, ``gen.dtype``)
  and ``reward.max_failure_fraction`` / ``failure_window`` (for its failed requests);
  every trainer (``train_step``, or a user op with role ``training``) gets its optimizer (``train.lr``, ``weight_decay``,
  ``max_grad_norm``), micro-batching (``max_tokens_per_micro_batch``, ``pack_sequences``), loss
  overrides (``train.loss``), ``checkpoint_every`` and ``max_nonfinite_steps``; a rule
  ``reward`` gets ``reward.timeout_s``, ``workers``, ``max_failure_fraction`` and
  ``failure_window`` (``areal_flow.rewards.pool``);
* ``compile.micro_batches`` (when null) from ``train.micro_batch_size``: the step's
  ``train.batch_size x n_samples`` sequences in micro-batches of that many; the compiler
  writes the count per DP rank into the plan and the trainer follows the plan;
* ``plan.run``: :class:`RunSpec` (name, folders, seed, steps, warm start, evaluation,
  scheduler, dtype).

The staleness bound k and the batch size B travel on the data edge into each
``train_step`` (written by the compiler), nowhere else. It imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import xxhash

from areal_flow.config import (DatasetConfig, DebugConfig, EvalConfig, ExperimentConfig, LoggingConfig,
                               SchedulerConfig, WarmStartConfig)
from areal_flow.graph import Graph
from compiler.workload import trainers


@dataclass
class RunSpec:
    """The run-level settings of a plan (``plan.run``).

    Attributes:
        name / out_dir: outputs go to ``<out_dir>/<name>/``.
        seed: data, sampling and initialisation seed.
        steps: optimizer steps (policy versions) of RL.
        warm_start: ``warm_start.*`` (supervised warm start of a tiny preset).
        eval: ``eval.*`` (held-out greedy accuracy before and after RL).
        scheduler: ``scheduler.*`` (local or ray, addresses, restarts).
        dtype: ``model.dtype`` for the engines and trainers.
        reward_model: training of a ``<preset>-rm`` reward model (``steps``, ``lr``).
        logging / debug: ``logging.*`` (W&B beside TensorBoard, the timeline), ``debug.*`` (memory
            profile, recorded edges).
        keep_old_runs: moved-aside earlier runs of the name kept (``runtime.run_dir``).
    """

    name: str
    out_dir: str
    seed: int
    steps: int
    warm_start: dict = field(default_factory=dict)
    eval: dict = field(default_factory=dict)
    scheduler: dict = field(default_factory=dict)
    dtype: str = "float32"
    reward_model: dict = field(default_factory=dict)
    logging: dict = field(default_factory=dict)
    debug: dict = field(default_factory=dict)
    keep_old_runs: int = 3

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> "RunSpec":
        asdict = dataclasses.asdict
        return cls(name=cfg.name, out_dir=cfg.out_dir, seed=cfg.seed, steps=cfg.train.steps,
                   warm_start=asdict(cfg.warm_start), eval=asdict(cfg.eval), scheduler=asdict(cfg.scheduler),
                   dtype=cfg.model.dtype, reward_model={"steps": cfg.reward.model_steps, "lr": cfg.reward.model_lr},
                   logging=asdict(cfg.logging), debug=asdict(cfg.debug), keep_old_runs=cfg.keep_old_runs)


_TRAIN = ("lr", "weight_decay", "max_grad_norm", "loss", "checkpoint_every", "max_tokens_per_micro_batch",
          "pack_sequences", "max_nonfinite_steps")
_ENGINE = {"max_batch_size": "gen.max_batch_size", "engine_dtype": "gen.dtype"}
LOWERED: dict[str, dict[str, str]] = {
    "dataset": {f.name: f"dataset.{f.name}" for f in dataclasses.fields(DatasetConfig)},
    "generate": {**_ENGINE, "interruptible": "gen.interruptible", "max_failure_fraction": "reward.max_failure_fraction",
                 "failure_window": "reward.failure_window"},
    "rollout": _ENGINE,
    "sync_weights": _ENGINE,  # it takes a weights input, so lower_attrs counts it among the generators
    "train_step": {k: f"train.{k}" for k in _TRAIN},
    "reward": {k: f"reward.{k}" for k in ("timeout_s", "workers", "max_failure_fraction", "failure_window")},
}
"""Op -> node attribute -> the config key it is lowered from (:func:`lower_attrs`; a dataset
node's attributes are ``dataset.*``): what a plan's attribute is checked against."""

RUN_CONFIG_KEYS: dict[str, str] = {
    "name": "name", "out_dir": "out_dir", "seed": "seed", "steps": "train.steps", "dtype": "model.dtype",
    "keep_old_runs": "keep_old_runs", "reward_model.steps": "reward.model_steps", "reward_model.lr": "reward.model_lr",
    **{f"{section}.{f.name}": f"{section}.{f.name}" for section, cls in
       (("warm_start", WarmStartConfig), ("eval", EvalConfig), ("scheduler", SchedulerConfig),
        ("logging", LoggingConfig), ("debug", DebugConfig)) for f in dataclasses.fields(cls)},
}
"""``plan.run`` key (dotted into its sections) -> the config key :class:`RunSpec` takes it from."""


def config_values(run: dict, nodes) -> list[tuple[str, dict]]:
    """The config values a plan was lowered from, to check them as a config's (with
    ``areal_flow.config_load.config_from_values``): ``("plan.run", {config key: value})``, then
    ``("plan node '<name>'", {...})`` per node with lowered attributes (``nodes``: the plan's
    :class:`~compiler.plan.NodePlan`). Keys neither table knows are left out (``Plan.from_dict``
    refuses them in ``plan.run``)."""
    flat = {f"{k}.{sub}" if isinstance(v, dict) else k: sv for k, v in run.items()
            for sub, sv in (v.items() if isinstance(v, dict) else [(None, v)])}
    out = [("plan.run", {RUN_CONFIG_KEYS[k]: v for k, v in flat.items() if k in RUN_CONFIG_KEYS})]
    for node in nodes:
        table = LOWERED.get(node.op, {})
        values = {table[k]: v for k, v in node.attrs.items() if k in table}
        if values:
            out.append((f"plan node '{node.name}'", values))
    return out


def lower_attrs(graph: Graph, cfg: ExperimentConfig) -> None:
    """Write the config's per-node settings into the nodes' attributes (module doc)."""
    steps = trainers(graph)
    for node in graph.nodes.values():
        if node in graph.generators():
            node.attrs.setdefault("max_batch_size", cfg.gen.max_batch_size)
            node.attrs.setdefault("engine_dtype", cfg.gen.dtype)
            if node.op == "generate":  # generation errors of one request: the reward's failure fraction
                node.attrs.setdefault("interruptible", cfg.gen.interruptible)
                node.attrs.update(max_failure_fraction=cfg.reward.max_failure_fraction,
                                  failure_window=cfg.reward.failure_window)
        elif node in steps:
            t = cfg.train
            node.attrs.update(lr=t.lr, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
                              loss=dict(t.loss), checkpoint_every=t.checkpoint_every,
                              max_tokens_per_micro_batch=t.max_tokens_per_micro_batch, pack_sequences=t.pack_sequences,
                              max_nonfinite_steps=t.max_nonfinite_steps)
        elif node.op == "reward" and node.attrs.get("fn") is not None:
            r = cfg.reward
            node.attrs.update(timeout_s=r.timeout_s, workers=r.workers, max_failure_fraction=r.max_failure_fraction,
                              failure_window=r.failure_window)


def micro_batches(cfg: ExperimentConfig, graph: Graph) -> int:
    """Micro-batches per step from ``train.micro_batch_size`` (at least 1)."""
    gens = graph.generators()
    samples = gens[0].attrs.get("n_samples", 1) if gens else 1
    return max(1, math.ceil(cfg.train.batch_size * samples / cfg.train.micro_batch_size))


def compile_program(graph: Graph, cfg: ExperimentConfig):
    """The runnable plan of ``graph`` under ``cfg`` (a :class:`compiler.plan.Plan`).

    Raises:
        the compiler's errors (``compiler.compile_plan``), each naming its culprit.
    """
    from compiler import compile_plan
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
    compile_cfg = dataclasses.replace(cfg.compile)
    if compile_cfg.micro_batches is None:
        compile_cfg.micro_batches = micro_batches(cfg, graph)
    plan = compile_plan(graph, cfg.cluster, compile_cfg)
    run = dataclasses.asdict(RunSpec.from_config(cfg))
    plan_id = xxhash.xxh64(json.dumps([plan.id, run], sort_keys=True).encode()).hexdigest()
    return dataclasses.replace(plan, run=run, id=plan_id)
