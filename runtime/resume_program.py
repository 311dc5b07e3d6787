"""Whether a resume runs the same program as the run it continues: :func:`check_resumable`.

Owns the comparison of a run folder's ``plan.json`` with the plan of the resuming run: which
``plan.run`` keys may change (:data:`RUNTIME_ONLY`, :data:`RUN_FOLDER`, ``train.steps`` when
it grows), which plan fields the allocation decides (:data:`PLACEMENT`,
:data:`NODE_PLACEMENT`: another allocation reshards the train_step's checkpoint), and the
one error that names the keys that differ. ``runtime.run_setup.RunSetup`` calls it.
"""

from __future__ import annotations

import json
from pathlib import Path

from areal_flow.ops.registry import TRAINING
from compiler.plan import Plan
from runtime.checkpoint import Checkpoint, ResumeError


RUNTIME_ONLY = ("scheduler", "logging", "eval", "debug", "keep_old_runs", "keep_checkpoints")
"""Keys of ``plan.run`` a resumed run may change: they do not touch what is trained."""

RUN_FOLDER = ("name", "out_dir")
"""Keys of ``plan.run`` that place the run folder: the folder given to ``--resume`` is the run,
so a run folder moved aside (``<name>.old-<stamp>``) or copied resumes where it now is."""

USER_KEYS = {"run.steps": "train.steps", "run.seed": "seed"}
"""The config key a user sets for a ``plan.run`` key a resume compares."""


PLACEMENT = ("allocation", "alternatives", "colocated", "overlapped", "idle_fraction", "step_time_s", "training_s",
             "generation_s", "sync_s", "warnings")
"""Plan fields the compiler derives from ``compile.allocation`` and the cluster's size: a
resume may change them together with the train_steps' strategies (it reshards)."""

NODE_PLACEMENT = ("mesh", "memory", "times", "micro_batches")
"""Fields of a plan node derived from the allocation (and ``strategy`` of a train_step;
``micro_batches`` counts per DP rank). A generation node's ``concurrent`` is not: it must stay."""


TRANSPORT = ("weights_dtype",)
"""Node attributes a resumed run may change: how weights travel, not what is trained (a plan
written before ``weights_dtype`` existed resumes under one that has it)."""


def program(data: dict, ignored_run: tuple[str, ...], placement: bool) -> dict:
    """The parts of a plan (as JSON) a resume must keep: all but ``id``, ``run`` keys in
    ``ignored_run``, node attributes in :data:`TRANSPORT` and, with ``placement``, what the
    allocation decides (:data:`PLACEMENT`, :data:`NODE_PLACEMENT`, the train_steps' strategies,
    the routes' meshes and costs, the cluster's size)."""
    run = {k: v for k, v in data.get("run", {}).items() if k not in ignored_run}
    nodes = [{**n, "attrs": {k: v for k, v in n["attrs"].items() if k not in TRANSPORT}} if "attrs" in n else n
             for n in data.get("nodes", [])]
    kept = {**{k: v for k, v in data.items() if k != "id"}, "run": run, "nodes": nodes}
    if not placement:
        return kept
    kept = {k: v for k, v in kept.items() if k not in PLACEMENT}
    kept["cluster"] = {k: v for k, v in data.get("cluster", {}).items() if k not in ("n_gpus_per_node", "n_nodes")}
    kept["nodes"] = [{k: v for k, v in n.items() if k not in NODE_PLACEMENT and
                      not (k == "strategy" and n.get("role") == TRAINING)} for n in nodes]
    kept["routes"] = [{k: v for k, v in r.items() if k in ("src", "dst", "replicas")} for r in data.get("routes", [])]
    return kept


def _reshards(before: dict, now: dict, written: dict[str, str]) -> list[str]:
    """One line per train_step whose strategy on resume differs from the one that wrote the
    checkpoint (``written``: the manifest's ``strategies``, else ``before``'s plan), naming
    both world sizes and strategies."""
    from compiler.strategy import ParallelStrategy

    def strategies(data: dict) -> dict[str, str]:
        return {n["name"]: n["strategy"] for n in data.get("nodes", []) if n.get("role") == TRAINING
                and n.get("strategy")}

    then, later = {**strategies(before), **written}, strategies(now)
    lines = []
    for name in sorted(then.keys() & later.keys()):
        a, b = ParallelStrategy.parse(then[name]), ParallelStrategy.parse(later[name])
        if a.short() != b.short():
            lines.append(f"train_step '{name}' reshards its checkpoint from world size {a.world_size} (strategy "
                         f"{a.short()}) to world size {b.world_size} (strategy {b.short()})")
    return lines


def check_resumable(plan: Plan, out_dir: Path, checkpoint: Checkpoint) -> list[str]:
    """Refuse a resume of ``out_dir`` by another program (its ``plan.json`` differs from
    ``plan`` beyond :data:`RUNTIME_ONLY` and :data:`RUN_FOLDER`, beyond ``train.steps`` when
    the new value is at least the checkpoint's version (continuing a run for more steps), and
    beyond the placement when ``compile.allocation`` or the cluster's size differs
    (:func:`program`: another allocation of the train_step reshards its checkpoint);
    ResumeError, naming the dotted keys that differ with both values, :func:`_differences`).
    Returns the reshard lines (:func:`_reshards`; empty when the strategies are the
    checkpoint's)."""
    ignored = RUNTIME_ONLY + RUN_FOLDER + (("steps",) if plan.run["steps"] >= checkpoint.version else ())
    try:
        before = json.loads((out_dir / "plan.json").read_text())
    except (OSError, ValueError) as e:
        raise ResumeError(f"cannot resume {out_dir}: its plan.json cannot be read ({e})") from None
    now = json.loads(plan.to_json())
    moved = (before.get("allocation"), before.get("cluster")) != (now.get("allocation"), now.get("cluster"))
    if program(before, ignored, placement=moved) == program(now, ignored, placement=moved):
        return _reshards(before, now, checkpoint.strategies())
    diffs = _differences(program(before, ignored, placement=moved), program(now, ignored, placement=moved))
    diffs.sort(key=lambda d: not (d[0].startswith("run.") or ".attrs." in d[0]))  # what the user set first
    shown = "; ".join(f"{USER_KEYS.get(k, k)}: {a} in the run, {b} now" for k, a, b in diffs[:MAX_SHOWN])
    more = f"; and {len(diffs) - MAX_SHOWN} more" if len(diffs) > MAX_SHOWN else ""
    steps = (f"; train.steps={plan.run['steps']} is below the checkpoint's step {checkpoint.version}"
             if any(k == "run.steps" for k, _, _ in diffs) else "")
    allocation = "; compile.allocation may change the train_steps' strategies only" if moved else ""
    raise ResumeError(f"cannot resume {out_dir}: its plan.json is another program than this run's (they differ in "
                      f"{shown}{more}{steps}{allocation}); resume with the same graph and config (train.steps "
                      "may grow, the train_step may get another strategy), or start a new run")


MAX_SHOWN = 6
"""Differences a refused resume lists (the rest are counted)."""


def _differences(before, now, key: str = "") -> list[tuple[str, str, str]]:
    """``(dotted key, value before, value now)`` of every leaf where two plans (as JSON)
    differ, in key order; a list of named entries (``nodes``) is keyed by name (e.g.
    ``nodes.train_step.attrs.lr``), a missing key shows as ``(absent)``, a value (JSON) is
    cut to 40 characters."""
    if isinstance(before, list) and isinstance(now, list) and all(
            isinstance(x, dict) and "name" in x for x in before + now):
        before, now = {x["name"]: x for x in before}, {x["name"]: x for x in now}
    if isinstance(before, dict) and isinstance(now, dict):
        absent = object()
        return [d for k in sorted(before.keys() | now.keys(), key=str)
                for d in _differences(before.get(k, absent), now.get(k, absent), f"{key}.{k}" if key else str(k))]
    if before == now:
        return []
    shown = [("(absent)" if not isinstance(v, (dict, list, str, int, float, bool, type(None))) else json.dumps(v))
             for v in (before, now)]
    return [(key, *(v if len(v) <= 40 else f"{v[:37]}..." for v in shown))]
