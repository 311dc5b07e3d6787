"""The tables of the lowering: which config key becomes which plan field.

Owns :class:`RunSpec` (``plan.run``), :data:`LOWERED` (node attributes lowered from config
keys) and :data:`RUN_CONFIG_KEYS`, read by the lowering (``compiler.program``), the plan
check (``compiler.plan_check``: a hand-edited field has its config key's type) and the
runtime's preflight (:func:`config_values`: the values pass the config's own checks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from areal_flow.config import (DatasetConfig, DebugConfig, EvalConfig, ExperimentConfig, LoggingConfig,
                               SchedulerConfig, WarmStartConfig)


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
        keep_checkpoints: complete checkpoints kept (``train.keep_checkpoints``, 0 = all;
            ``runtime.checkpoint.rotate``).
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
    keep_checkpoints: int = 0

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> "RunSpec":
        asdict = dataclasses.asdict
        return cls(name=cfg.name, out_dir=cfg.out_dir, seed=cfg.seed, steps=cfg.train.steps,
                   warm_start=asdict(cfg.warm_start), eval=asdict(cfg.eval), scheduler=asdict(cfg.scheduler),
                   dtype=cfg.model.dtype, reward_model={"steps": cfg.reward.model_steps, "lr": cfg.reward.model_lr},
                   logging=asdict(cfg.logging), debug=asdict(cfg.debug), keep_old_runs=cfg.keep_old_runs,
                   keep_checkpoints=cfg.train.keep_checkpoints)


_TRAIN = ("lr", "lr_warmup_steps", "weight_decay", "max_grad_norm", "loss", "checkpoint_every",
          "max_tokens_per_micro_batch", "pack_sequences", "shared_prefix", "max_nonfinite_steps", "gradient_accumulation_steps")
_ENGINE = {"max_batch_size": "gen.max_batch_size", "engine_dtype": "gen.dtype",
           "engine_lm_head_dtype": "gen.lm_head_dtype", "engine_cpu_kernels": "gen.cpu_kernels",
           "vllm_compile": "gen.vllm_compile"}
LOWERED: dict[str, dict[str, str]] = {
    "dataset": {f.name: f"dataset.{f.name}" for f in dataclasses.fields(DatasetConfig)},
    "generate": {**_ENGINE, "interruptible": "gen.interruptible", "max_failure_fraction": "reward.max_failure_fraction",
                 "failure_window": "reward.failure_window"},
    "rollout": {**_ENGINE, "max_failure_fraction": "reward.max_failure_fraction",
                "failure_window": "reward.failure_window"},
    "sync_weights": _ENGINE,  # it takes a weights input, so lower_attrs counts it among the generators
    "train_step": {k: f"train.{k}" for k in _TRAIN},
    "reward": {k: f"reward.{k}" for k in ("timeout_s", "workers", "max_failure_fraction", "failure_window")},
}
"""Op -> node attribute -> the config key it is lowered from (:func:`lower_attrs`; a dataset
node's attributes are ``dataset.*``): what a plan's attribute is checked against."""

DERIVED: dict[str, tuple[str, ...]] = {"sync_weights": ("weights_dtype",)}
"""Op -> attributes ``lower_attrs`` derives from several config keys rather than lowers from one
(``weights_dtype``: ``gen.dtype``, ``model.dtype``, the engine and the device,
``areal_flow.dtypes.weights_dtype``); each is also an argument of the op, so a plan's value is
checked by the argument's type and, by ``compiler.plan_check``, as a dtype."""

RUN_CONFIG_KEYS: dict[str, str] = {
    "name": "name", "out_dir": "out_dir", "seed": "seed", "steps": "train.steps", "dtype": "model.dtype",
    "keep_old_runs": "keep_old_runs", "keep_checkpoints": "train.keep_checkpoints",
    "reward_model.steps": "reward.model_steps", "reward_model.lr": "reward.model_lr",
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
