"""Benchmark (not a test): a bounded soak run, memory and queues over time.

Runs one small GRPO job (arith_grpo, tiny model, evaluation and trace off) for many short
steps on the local scheduler and samples, every ``--every`` seconds: the resident memory
(RSS, MiB) of the driver and of every worker process (``psutil``), the steps done (lines of
``trajectories.jsonl`` / samples per step), and the router's queues: groups being
generated (``AdmissionController.running``), groups admitted and not yet trained
(``accepted + running - steps * B``, at most ``(k + 2) * B`` while a step's batch is being
trained: the staleness rule admits ``(k + v + 1) * B`` by version ``v``, AReaL, Fu et al.
2025, §5) and groups a replica still holds for redelivery (``Router.unconfirmed``). It
prints the samples as a table, then the median RSS of the first and last quarter of the
samples taken after the first step (flat memory: a ratio near 1) and the largest queue
sizes against their bound. With ``--tracemalloc`` the driver's Python allocations are traced
(``tracemalloc``, 8 frames, started at the first sample): a snapshot at the second sample and
one at the last (the run still live), and the
allocation sites whose live memory grew most between them are printed with their growth per
step (bytes), to find what the driver keeps per step.

    python bench/soak.py [--every 2] [--tracemalloc] [key=value ...]   # e.g. train.steps=400
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from areal_flow.cli import load_flow  # noqa: E402
from areal_flow.config_load import load_config  # noqa: E402
from areal_flow.cli.run import run_experiment
from runtime.run_setup import RunSetup  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SMALL = ["train.steps=300", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false",
         "logging.trace=false"]
MIB = 1 << 20


def rss_mib(proc: psutil.Process) -> tuple[float, float]:
    """(driver RSS, sum of its child processes' RSS), MiB."""
    children = 0.0
    for child in proc.children(recursive=True):
        try:
            children += child.memory_info().rss / MIB
        except psutil.NoSuchProcess:
            pass
    return proc.memory_info().rss / MIB, children


def _print_growth(first_step: int, first: tracemalloc.Snapshot, last_step: int, last: tracemalloc.Snapshot,
                  top: int = 8) -> None:
    """The ``top`` allocation sites of the driver whose live bytes grew most from ``first``
    (taken after step ``first_step``) to ``last`` (after ``last_step``), per step between."""
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
    diff = last.filter_traces(ignore).compare_to(first.filter_traces(ignore), "traceback")
    span = max(1, last_step - first_step)
    total = sum(d.size_diff for d in diff)
    print(f"driver Python allocations (tracemalloc), steps {first_step} -> {last_step}: {total / 1024:+.1f} KiB "
          f"({total / span:+.1f} B per step); largest changes:")
    for d in diff[:top]:
        frames = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in list(d.traceback)[::-1][:4])
        print(f"  {d.size_diff / 1024:+9.1f} KiB ({d.size_diff / span:+8.1f} B/step, {d.count_diff:+6d} blocks)  {frames}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--tracemalloc", action="store_true", help="trace the driver's allocations: the top growth")
    parser.add_argument("overrides", nargs="*", help="config overrides after the soak's defaults")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="soak-"))
    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*SMALL, *args.overrides, f"out_dir={out}", "name=soak"])
    graph = load_flow(REPO / "graphs/arith_grpo.py")(cfg)
    routers = []
    make_router = RunSetup.router

    def keep_router(setup, *a, **kw):  # the router lives in this process: its admission state is readable
        routers.append(make_router(setup, *a, **kw))
        return routers[-1]

    RunSetup.router = keep_router
    per_step = cfg.train.batch_size * cfg.gen.n_samples
    bound = (cfg.async_.max_staleness + 2) * cfg.train.batch_size
    samples: list[tuple[float, int, float, float, int, int, int]] = []
    done = threading.Event()
    traced: list[tuple[int, tracemalloc.Snapshot]] = []  # (steps done, snapshot) at the second and last sample

    def sample() -> None:
        me, start = psutil.Process(), time.perf_counter()
        log = out / "soak" / "trajectories" / "trajectories.jsonl"
        while not done.wait(args.every):
            if not routers:
                continue
            steps = sum(1 for _ in log.open()) // per_step if log.is_file() else 0
            if steps == 0:  # workers still starting: not the steady state
                continue
            if args.tracemalloc and not tracemalloc.is_tracing():
                tracemalloc.start(8)  # from the first step: tracing the startup too is far slower
            elif args.tracemalloc:  # the second sample's, then the latest (the run's objects still live)
                traced[1 if traced else 0:] = [(steps, tracemalloc.take_snapshot())]
            driver, workers = rss_mib(me)
            router = routers[-1]
            admission = router.admission
            samples.append((time.perf_counter() - start, steps, driver, workers, admission.running,
                            admission.accepted + admission.running - steps * cfg.train.batch_size,
                            sum(len(held) for held in router.unconfirmed)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        summary = run_experiment(graph, cfg, show_progress=False)
    finally:
        done.set()
        sampler.join()
    if len(traced) == 2:
        _print_growth(*traced[0], *traced[1])
    print(f"{'t (s)':>7} {'step':>5} {'driver MiB':>11} {'workers MiB':>12} {'generating':>11} "
          f"{'not trained':>12} {'held':>5}")
    for t, step, driver, workers, running, untrained, held in samples[:: max(1, len(samples) // 25)]:
        print(f"{t:7.1f} {step:5d} {driver:11.1f} {workers:12.1f} {running:11d} {untrained:12d} {held:5d}")
    quarter = max(1, len(samples) // 4)
    first = statistics.median(d + w for _, _, d, w, *_ in samples[:quarter])
    last = statistics.median(d + w for _, _, d, w, *_ in samples[-quarter:])
    print(f"{cfg.train.steps} steps, {summary['samples_trained']} samples in {summary['wall_s']:.1f} s; "
          f"{len(samples)} samples every {args.every} s")
    print(f"RSS (driver + workers), median of the first / last quarter of the samples: {first:.1f} / {last:.1f} MiB "
          f"(ratio {last / first:.3f})")
    print(f"groups generating: max {max(s[4] for s in samples)}; admitted, not trained: max "
          f"{max(s[5] for s in samples)} (bound (k + 2) * B = {bound}); held for redelivery: max "
          f"{max(s[6] for s in samples)}")


if __name__ == "__main__":
    main()
