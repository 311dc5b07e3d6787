"""Predicted vs measured idle time of a run: the simulator calibrated on the run's own trace.

Owns ``areal-flow timeline runs/<name> --simulate``. The compiler's simulator
(``compiler.simulate``) and a run's timeline (``runtime.trace``) name their spans by the
plan's nodes (``generate``, ``train_step``, ``sync_weights``), so their busy fractions can be
set side by side. The plan's own cost figures come from a device preset's peak numbers, not
from this machine, so the simulator is first *calibrated* on the run (:func:`calibrate`):

* generation: seconds per response token = the generator's engine-step seconds (prefill
  included) until the last trained group finished, over the response tokens of the trained
  trajectories. The calibrated decode step costs that much per live response and nothing
  per step (``DecodeCost`` with only ``flops_token``, ``compute = 1``; no prefill term);
* each training-side node (role training/inference): its busy seconds over the tokens it
  trained (prompt + response), the simulator's per-step time scaled by the batch's tokens;
* ``sync_s``: per version, publish + receive + load seconds (a replica's receive and load
  averaged over the replicas);
* lengths: prompt tokens (mean) and a lognormal fitted to the response lengths (mean and
  the standard deviation of their logarithm, ``compiler.lengths``).

A resumed (or restarted) run is calibrated on its last attempt only (``runtime.timeline.
split_attempts``): its spans, and the trajectories it trained (steps ``>= v0``, ``v0`` = the
version it started from; without an attempt marker, the first version it loaded minus 1).
Not over all attempts: each restarts the engines (a warm-up inside the window), may run
another allocation (a resharded resume) and is separated from the next by a restart gap,
none of which the simulator's one contiguous run models.
Both sides use the simulator's window: from the load of version ``v0 + w``,
``w = max(1, S // 4)``, to the load of version ``v0 + S`` (``S`` = versions the replicas
loaded in the attempt, the simulator's steps from its version 0 = ``v0``); a node's busy fraction is
its seconds inside the window over ``window x instances`` (the generator's replicas, else 1).
Nodes of role ``cpu`` (reward, advantage) are not simulated: the simulator charges them
nothing; their measured fraction is printed alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from areal_flow.config_compile import LengthDistConfig
from areal_flow.ops.registry import ROUTE
from compiler.decode import DecodeCost
from compiler.lengths import LengthDist
from compiler.plan import Plan
from compiler.simulate import SimResult, simulate
from runtime.timeline import TimelineError, load_events, load_plan, split_attempts
from runtime.trace import ATTEMPT


class CalibrationError(TimelineError):
    """The run is too short or lacks a file the calibration needs (names it)."""


@dataclass(frozen=True)
class Calibration:
    """Costs measured on one run (hence on the machine it ran on), the simulator's inputs.

    Attributes:
        gen_s_per_token: generator seconds per response token (module doc).
        node_s_per_token: training-side node -> busy seconds per trained token.
        sync_s: seconds per version (publish + receive + load).
        prompt_tokens / response_tokens: means over the trained trajectories, tokens.
        response_log_sigma: standard deviation of ``log(response tokens)``.
        versions: ``S``, the policy versions the replicas loaded (in the last attempt).
        first_version: ``v0``, the version the last attempt started from (0: not resumed).
    """

    gen_s_per_token: float
    node_s_per_token: dict
    sync_s: float
    prompt_tokens: float
    response_tokens: float
    response_log_sigma: float
    versions: int
    first_version: int = 0


@dataclass(frozen=True)
class Comparison:
    """Predicted (the calibrated simulation) vs measured, over the same window.

    Attributes:
        calibration: what the simulator was given. simulated: its result.
        predicted / measured: node -> busy fraction (predicted: the simulated nodes only).
        window_s: measured window, seconds; steps: train steps in it.
        measured_step_s: measured seconds per step in the window.
    """

    calibration: Calibration
    simulated: SimResult
    predicted: dict
    measured: dict
    window_s: float
    steps: int
    measured_step_s: float


def _sync_name(plan: Plan) -> str:
    """The route node (``sync_weights``) the replicas name their weight spans after."""
    return next((n.name for n in plan.nodes if n.grain == ROUTE), "weights")


def _loads(events: list[dict], sync: str) -> dict[int, int]:
    """Version -> the end (µs) of its last replica's ``load`` span."""
    loads: dict[int, int] = {}
    for e in events:
        if e["name"] == sync and e["args"].get("phase") == "load":
            v = e["args"]["version"]
            loads[v] = max(loads.get(v, 0), e["ts"] + e["dur"])
    return loads


def _trajectories(run_dir: Path, first_step: int) -> list[dict]:
    """The trained trajectories of steps ``>= first_step``."""
    path = run_dir / "trajectories" / "trajectories.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    rows = [r for r in rows if r["step"] >= first_step]
    if not rows:
        raise CalibrationError(f"{path}: no trained trajectories of steps >= {first_step} to count tokens from")
    return rows


def _last_attempt(events: list[dict], sync: str) -> tuple[int, int, list[dict]]:
    """``(attempt number (1 = the first), v0, spans)`` of the run's last attempt (module doc)."""
    attempts = split_attempts(events)
    first, spans = attempts[-1]
    if not any(e["name"] == ATTEMPT and e["cat"] == "run" for e in events):  # no marker: from its first load
        loaded = _loads(spans, sync)
        first = min(loaded) - 1 if loaded else 0
    return len(attempts), first, spans


def calibrate(run_dir: Path | str) -> tuple[Plan, Calibration, list[dict]]:
    """The run's plan, its :class:`Calibration` and the spans (``ph: X`` events) of its last
    attempt (module doc).

    Raises:
        CalibrationError: no generation node, no trajectories, fewer than 2 weight loads, no
            generator spans.
        TimelineError: no plan.json or no trace.
    """
    run_dir = Path(run_dir)
    plan = load_plan(run_dir)
    sync, gen = _sync_name(plan), next((n for n in plan.nodes if n.role == "generation"), None)
    if gen is None:
        raise CalibrationError(f"{run_dir / 'plan.json'}: no generation node to calibrate the simulator on")
    attempt, first, events = _last_attempt(load_events(run_dir), sync)
    loads = _loads(events, sync)
    if len(loads) < 2:
        where = (f" in the last attempt (attempt {attempt}, from version {first}; the simulator is calibrated on it "
                 "alone)" if attempt > 1 else f" (the run resumed from version {first})" if first else "")
        raise CalibrationError(f"{run_dir / 'trace.json'}: {len(loads)} weight load(s) of '{sync}'{where}; the "
                               "comparison needs at least 2 (run more train.steps)")
    rows = _trajectories(run_dir, first)
    trained = (max(r["step"] for r in rows) + 1) * plan.batch_groups
    engine = [e for e in events if e["name"] == gen.name and e["cat"] == "node"]
    ends = [e["ts"] + e["dur"] for e in engine if any(i < trained for i in e["args"].get("finished", []))]
    if not ends:
        raise CalibrationError(f"{run_dir / 'trace.json'}: no '{gen.name}' engine step finished a trained group")
    gen_s = sum(e["dur"] for e in engine if e["ts"] + e["dur"] <= max(ends)) / 1e6
    out_tokens = [len(r["output_ids"]) for r in rows]
    all_tokens = sum(out_tokens) + sum(len(r["prompt_ids"]) for r in rows)
    busy: dict[str, int] = defaultdict(int)
    for e in events:
        if e["cat"] == "node":
            busy[e["name"]] += e["dur"]
    per_token = {n.name: busy[n.name] / 1e6 / all_tokens for n in plan.nodes if n.role in ("training", "inference")}
    replicas = len({e["pid"] for e in engine})
    syncs = [e for e in events if e["name"] == sync and e["cat"] == "node"]
    publish_us = sum(e["dur"] for e in syncs if e["args"].get("phase") == "publish")
    replica_us = sum(e["dur"] for e in syncs if e["args"].get("phase") in ("receive", "load")) / replicas
    sync_s = (publish_us + replica_us) / len(loads) / 1e6
    logs = [math.log(max(1, n)) for n in out_tokens]
    mean_log = sum(logs) / len(logs)
    return plan, Calibration(
        gen_s_per_token=gen_s / sum(out_tokens), node_s_per_token=per_token, sync_s=sync_s,
        prompt_tokens=(all_tokens - sum(out_tokens)) / len(rows), response_tokens=sum(out_tokens) / len(rows),
        response_log_sigma=math.sqrt(sum((x - mean_log) ** 2 for x in logs) / len(logs)),
        versions=max(loads) - first, first_version=first,
    ), events


def calibrated_plan(plan: Plan, cal: Calibration) -> tuple[Plan, DecodeCost]:
    """``plan`` with the measured lengths, training times and ``sync_s``, and the measured decode cost."""
    w = dict(plan.workload)
    budget = w["new_tokens"]
    w["prompt_len"] = max(1, round(cal.prompt_tokens))
    sigma = min(5.0, max(cal.response_log_sigma, 0.01))  # compile.length_dist's range (0, 5]
    mean = min(10.0, cal.response_tokens / budget)  # a fraction of the budget, at most 10
    w["length_dist"] = dataclasses.asdict(LengthDistConfig(kind="lognormal", mean=mean, sigma=sigma))
    dist = LengthDist(LengthDistConfig(**w["length_dist"]), budget)
    expected = w["n_sequences"] * (w["prompt_len"] + dist.mean)  # the simulator's tokens of an average step
    nodes = tuple(dataclasses.replace(n, times={"compute": cal.node_s_per_token[n.name] * expected})
                  if n.name in cal.node_s_per_token else n for n in plan.nodes)
    cost = DecodeCost(dense_bytes=0.0, expert_bytes=0.0, expert_share=0.0, kv_bytes=0.0, bandwidth=1.0, compute=1.0,
                      flops_token=cal.gen_s_per_token, flops_ctx=0.0, comm_fixed=0.0, comm_per_seq=0.0,
                      overhead_s=0.0, prompt_len=0)
    return dataclasses.replace(plan, workload=w, nodes=nodes, sync_s=cal.sync_s), cost


def compare(run_dir: Path | str) -> Comparison:
    """Simulate the run's plan calibrated on its trace (its last attempt) and measure the same
    window (module doc).

    Raises:
        CalibrationError / TimelineError: see :func:`calibrate`.
    """
    plan, cal, events = calibrate(run_dir)
    sim_plan, cost = calibrated_plan(plan, cal)
    result = simulate(sim_plan, steps=cal.versions, seed=int(plan.run.get("seed", 0)), decode_cost=cost)
    loads, sync = _loads(events, _sync_name(plan)), _sync_name(plan)
    window = (cal.first_version + result.warmup, cal.first_version + cal.versions)
    missing = [v for v in window if v not in loads]
    if missing:
        raise CalibrationError(f"{Path(run_dir) / 'trace.json'}: no '{sync}' load of version {missing[0]}, an end "
                               f"of the window {window[0]}..{window[1]} (loaded: {sorted(loads)})")
    lo, hi = loads[window[0]], loads[window[1]]
    gen = next(n for n in plan.nodes if n.role == "generation")
    seconds: dict[str, int] = defaultdict(int)
    workers: dict[str, set] = defaultdict(set)
    for e in events:
        if e["cat"] == "node":
            seconds[e["name"]] += max(0, min(e["ts"] + e["dur"], hi) - max(e["ts"], lo))
            workers[e["name"]].add(e["pid"])
    measured = {n.name: seconds[n.name] / ((hi - lo) * (len(workers[n.name]) if n.name == gen.name else 1))
                for n in plan.nodes if n.name in seconds}
    steps = cal.versions - result.warmup
    return Comparison(cal, result, dict(result.busy), measured, (hi - lo) / 1e6, steps, (hi - lo) / 1e6 / steps)


def format_comparison(c: Comparison) -> str:
    """The side-by-side table ``areal-flow timeline --simulate`` prints."""
    cal = c.calibration
    lines = [f"predicted (compiler.simulate, calibrated on this run's own trace) vs measured, versions "
             f"{cal.first_version + c.simulated.warmup}..{cal.first_version + cal.versions} ({c.steps} steps, "
             f"{c.window_s:.2f} s measured" + (f"; the attempt resumed from version {cal.first_version}"
                                              if cal.first_version else "") + ")",
             f"calibration, measured on this run: generation {cal.gen_s_per_token * 1e3:.3f} ms per response token; "
             + "; ".join(f"{n} {s * 1e3:.4f} ms per trained token" for n, s in cal.node_s_per_token.items())
             + f"; sync {cal.sync_s * 1e3:.1f} ms per version; prompts {cal.prompt_tokens:.1f} tokens, responses "
             f"{cal.response_tokens:.2f} tokens (lognormal, log-sd {cal.response_log_sigma:.2f})",
             "", "node            predicted busy  measured busy  predicted idle  measured idle"]
    for name, got in c.measured.items():
        if name in c.predicted:
            p = c.predicted[name]
            lines.append(f"{name:14s}  {p:14.1%}  {got:13.1%}  {1 - p:14.1%}  {1 - got:13.1%}")
        else:
            lines.append(f"{name:14s}  {'-':>14s}  {got:13.1%}  {'-':>14s}  {1 - got:13.1%}   "
                         "(cpu node: not simulated)")
    lines.append(f"{'step time':14s}  {c.simulated.step_time_s:12.3f} s  {c.measured_step_s:11.3f} s")
    return "\n".join(lines)
