"""Issue 24: a sample of the plans ``compile`` emits runs. ``test_executable_property`` checks
that every plan drawn from random small clusters x allocations x the shipped graphs passes the
executability predicate; here a seeded draw from the same kind of cases, cut to what two CPU
cores can run (one machine, 2-3 devices), picks three plans (the first two the compiler chose
itself, the first manual allocation it accepted), and from the same kind of draw on up to 4
devices the first plan the compiler chose with a critic on several ranks (the policy trainer's,
``compiler.choose``), and runs each for two steps through the same entry as ``areal-flow run``:
every sample trained once, in its step's slot, staleness <= k.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from areal_flow.cli import load_flow
from areal_flow.cli.run import run_experiment
from areal_flow.config_load import load_config
from areal_flow.types import REPLAYED
from compiler import AllocationError, InfeasiblePlanError
from compiler.program import compile_program
from compiler.strategy import ParallelStrategy
from runs import records

REPO = Path(__file__).resolve().parents[1]
GRAPHS = ("arith_grpo", "arith_ppo", "arith_grpo_moe", "arith_grpo_ref_rm", "arith_grpo_judge", "arith_grpo_replay")
SEED = 7


def _strategy(rng: random.Random) -> str:
    degrees = {letter: rng.choice((1, 1, 2)) for letter in "tpce"}
    return f"d{rng.choice((1, 2, 3, 4))}" + "".join(f"{k}{v}" for k, v in degrees.items() if v > 1)


def _draw(rng: random.Random, devices: tuple[int, ...] = (2, 3)) -> tuple[str, list[str]]:
    graph = rng.choice(GRAPHS)
    overrides = ["cluster.n_nodes=1", f"cluster.n_gpus_per_node={rng.choice(devices)}", "cluster.gpu=cpu",
                 f"train.batch_size={rng.randint(1, 3)}", f"gen.n_samples={rng.randint(2, 4)}"]
    if rng.random() < 0.5:
        allocation = f"gen:{_strategy(rng)} + train:{_strategy(rng)}"
        extra = {"arith_ppo": "critic_step", "arith_grpo_judge": "judge"}.get(graph)
        if extra is not None:
            allocation += f" {rng.choice(('+', '|'))} {extra}:{_strategy(rng)}"
        overrides.append(f"compile.allocation={allocation}")
    return graph, overrides


def _sample() -> list[tuple[str, list[str]]]:
    """The first two compiler-chosen and the first manual plan ``compile`` accepts, in draw order."""
    rng, auto, manual = random.Random(SEED), [], []
    for _ in range(2000):
        graph, overrides = _draw(rng)
        chosen = manual if overrides[-1].startswith("compile.allocation=") else auto
        if len(chosen) == (1 if chosen is manual else 2):
            continue
        cfg = load_config(REPO / "graphs" / f"{graph}.yaml", overrides)
        try:
            compile_program(load_flow(REPO / "graphs" / f"{graph}.py")(cfg), cfg)
        except (AllocationError, InfeasiblePlanError):
            continue
        chosen.append((graph, overrides))
        if len(auto) == 2 and len(manual) == 1:
            return auto + manual
    raise AssertionError("the draw found fewer than 2 compiler-chosen and 1 manual plan")


def _critic_sample() -> tuple[str, list[str]]:
    """The first compiler-chosen plan of a draw on 2-4 devices whose critic runs on several ranks."""
    rng = random.Random(SEED)
    for _ in range(2000):
        graph, overrides = _draw(rng, (2, 3, 4))
        if graph != "arith_ppo" or overrides[-1].startswith("compile.allocation="):
            continue
        cfg = load_config(REPO / "graphs" / f"{graph}.yaml", overrides)
        try:
            plan = compile_program(load_flow(REPO / "graphs" / f"{graph}.py")(cfg), cfg)
        except InfeasiblePlanError:
            continue
        if ParallelStrategy.parse(plan.node("critic_step").strategy).world_size > 1:
            return graph, overrides
    raise AssertionError("the draw found no compiler-chosen plan with a critic on several ranks")


def _cases() -> list:
    """The four plans; ``make test`` (CI) runs the manual allocation's, a placement the user wrote."""
    first, second, manual = _sample()
    return [first, second, pytest.param(manual, marks=pytest.mark.ci), _critic_sample()]


@pytest.mark.slow
@pytest.mark.parametrize("case", _cases(),
                         ids=lambda c: c[0] + ":" + c[1][-1].split("=", 1)[1].replace(" ", ""))
def test_a_drawn_plan_runs_two_steps_with_every_sample_trained_once(tmp_path, warm_cache, case):
    graph, overrides = case
    flow = load_flow(REPO / "graphs" / f"{graph}.py")
    cfg = load_config(REPO / "graphs" / f"{graph}.yaml", [
        *overrides, "train.steps=2", "warm_start.steps=10", "reward.model_steps=10", "eval.enabled=false",
        f"out_dir={tmp_path}", "name=drawn"])  # short warm starts (a reward model's too): the plan is under test
    summary = run_experiment(flow(cfg), cfg, show_progress=False)
    batch, n, k = cfg.train.batch_size, cfg.gen.n_samples, cfg.async_.max_staleness
    fresh = [r for r in records(tmp_path / "drawn") if REPLAYED not in r.get("meta", {})]
    assert len(fresh) == len({(r["group_id"], r["sample_id"]) for r in fresh}) == 2 * batch * n, summary
    assert Counter(r["group_id"] for r in fresh) == {g: n for g in range(2 * batch)}
    assert all(r["step"] == r["group_id"] // batch and r["staleness"] <= k for r in fresh)
