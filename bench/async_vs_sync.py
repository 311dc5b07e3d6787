"""Benchmark (not a test): the same GRPO job, synchronous (k=0) vs asynchronous (k>=1).

Every variant trains the same samples (``train.steps * train.batch_size * gen.n_samples``,
the same prompts) from the same warm-started model on this machine, one after the other in
one process tree; with ``--repeats R`` the variants alternate R times (interleaved, so a
change of machine load hits all of them alike). Evaluation is off so only the
generate/train loop is timed. Two wall times per run: the summary's (the RL phase,
worker start-up included: spawning, imports, model loading, ~15 s here) and the loop's,
from the generator's first engine step to the last span of the run's trace (what asynchrony
can change), less the time the generator sat idle before every other worker had started
(start-up, not the loop: a trainer still loading its model; a worker that started earlier
than the generator only waited). It prints
both with their ratios, the load average at each round's start and at the end, each run's
generator and trainer busy time, the generator's batch
occupancy over time and the ideal speed-up computed from the synchronous runs' spans.

    python bench/async_vs_sync.py [--task arith|longtail] [--repeats R] [async_k=K] [key=value ...]

``--task arith`` (default): ``graphs/arith_grpo.py`` (2-5 token answers: no tail).
``--task longtail``: ``graphs/longtail_grpo.py`` (3-192 token answers, Zipf-distributed,
``areal_flow.tasks.longtail``) with ``train.steps=10`` unless the command line says
otherwise (1,280 samples a variant); it adds a variant, asynchronous with
``gen.interruptible=false`` (in-flight responses finish with the old weights before an
update), to measure interruptible generation on vs off. Both tasks also run ``sync-1t``,
the synchronous run on one thread per worker, for the ideal (below).

Occupancy comes from the run's trace (``runtime.trace``): every engine-step span of the
generation replica carries ``rows`` (sequences decoded in that step) and ``slots`` (the
engine's batch capacity); occupancy is ``rows / slots``, 0 while the engine is idle. Busy
times are the union of a worker's spans (nested spans, e.g. a train step's forward and
backward phases inside its ``train_step`` span, count once).

Ideal speed-up. Two synchronous runs per round: ``sync`` as the runtime runs it (phases
alternate, each worker gets every core: ``c`` threads) and ``sync-1t``
(``scheduler.threads_per_worker=1``): the same phases, still alternating, each on one
core, which is what the asynchronous run gives each of its two overlapped phases on this
2-core box. From ``sync`` (N optimizer steps, loop wall ``W_sync``): generator busy ``G``,
trainer busy ``T``, and ``O = max(0, W_sync - G - T)``, the time neither is busy (messages,
admission, checkpoint writes), which asynchrony does not remove. From ``sync-1t``:

* generator busy ``G1 = sum_j d_j + E1``: ``d_j`` its engine-step spans, ``E1`` its other
  generator spans (reward per group, weight receive/load); trainer busy ``T1``;
* every step decodes ``r_j`` rows and yields one token per row, so the run decodes
  ``R = sum_j r_j`` tokens. A least-squares line ``d(r) = a + b r`` over the engine steps
  gives the one-core step time at full occupancy ``d(C)``, ``C`` the slots, so generation
  with a batch that never empties takes ``G1_full = (R / C) d(C) + E1``;
* asynchronously, generating step i+1 overlaps training step i: a two-stage pipeline of N
  steps of ``g = G1_full / N`` and ``t = T1 / N`` takes ``g + t + (N - 1) max(g, t)`` (the
  makespan of N identical jobs on a two-machine flow shop, Johnson 1954), so
  ``W_async* = max(G1_full, T1) + min(G1_full, T1) / N + O`` and the ideal ratio is
  ``W_sync / W_async*``.

So the ratio is bounded by ``(G + T + O) / (max(G1_full, T1) + O)``: asynchrony gains the
tail (``G1 / G1_full``, large when a step's time barely depends on its rows) and the
overlap (the shorter phase hidden), and loses each phase's speed-up from one to ``c``
threads (``G1 / G``, ``T1 / T``, printed). The ideal still assumes the two overlapped phases
do not slow each other (shared caches, memory bandwidth, other jobs on the box).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_flow.cli import load_flow  # noqa: E402
from areal_flow.config_load import load_config  # noqa: E402
from areal_flow.cli.run import run_experiment  # noqa: E402
from runtime.trace import read_spans  # noqa: E402

GRAPHS = {"arith": "arith_grpo", "longtail": "longtail_grpo"}
BINS = 40  # columns of the occupancy timeline
DEFAULTS = {"longtail": ["train.steps=10"]}  # before the command line's overrides: one run of 1,280 samples


def engine_steps(spans: list[dict]) -> list[dict]:
    """The engine-step spans (those carrying ``rows`` and ``slots``), by start time."""
    return sorted((s for s in spans if "rows" in s.get("args", {}) and "slots" in s["args"]), key=lambda s: s["ts"])


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``y = a + b x``; ``b = 0`` (``a`` the mean) when the ``xs``
    are all equal.

    Raises:
        ValueError: no points.
    """
    if not xs:
        raise ValueError("fit_line: no points")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def ideal_ratio(wall_s: float, gen_s: float, train_s: float, steps_1t: list[dict], gen_other_1t_s: float,
                train_1t_s: float, n_steps: int) -> dict:
    """The ideal asynchronous wall and speed-up from the two synchronous runs (module doc).

    Args:
        wall_s / gen_s / train_s: ``W_sync``, ``G``, ``T`` of the all-cores synchronous run, seconds.
        steps_1t: engine-step spans of the one-thread synchronous run (``dur`` microseconds,
            ``args.rows``, ``args.slots``).
        gen_other_1t_s / train_1t_s: ``E1`` and ``T1`` of the one-thread run, seconds.
        n_steps: N, optimizer steps.

    Returns:
        ``{"G", "T", "O", "G1", "T1", "tokens", "step_full_s", "G1_full", "ideal_async_s",
        "ideal_ratio"}`` (seconds; ``tokens`` = R, ``step_full_s`` = ``d(C)`` on one core).

    Raises:
        ValueError: no engine steps or ``n_steps < 1``.
    """
    if not steps_1t or n_steps < 1:
        raise ValueError(f"ideal_ratio: need engine steps and n_steps >= 1 (got {len(steps_1t)}, {n_steps})")
    slots = steps_1t[0]["args"]["slots"]
    rows = [s["args"]["rows"] for s in steps_1t]
    a, b = fit_line(rows, [s["dur"] / 1e6 for s in steps_1t])
    step_full = a + b * slots
    g1_full = sum(rows) / slots * step_full + gen_other_1t_s
    other = max(0.0, wall_s - gen_s - train_s)
    ideal = max(g1_full, train_1t_s) + min(g1_full, train_1t_s) / n_steps + other
    return {"G": gen_s, "T": train_s, "O": other, "G1": sum(s["dur"] for s in steps_1t) / 1e6 + gen_other_1t_s,
            "T1": train_1t_s, "tokens": sum(rows), "step_full_s": step_full, "G1_full": g1_full,
            "ideal_async_s": ideal, "ideal_ratio": wall_s / ideal}


def union_seconds(spans: list[dict]) -> float:
    """Seconds covered by at least one of ``spans`` (``ts``, ``dur`` microseconds): nested or
    overlapping spans count once."""
    total, end = 0, None
    for s in sorted(spans, key=lambda s: s["ts"]):
        lo, hi = s["ts"], s["ts"] + s["dur"]
        if end is None or lo >= end:
            total, end = total + hi - lo, hi
        elif hi > end:
            total, end = total + hi - end, hi
    return total / 1e6


def occupancy_bins(steps: list[dict], start_us: int, end_us: int, bins: int = BINS) -> list[float]:
    """Mean occupancy (``rows / slots``, 0 while idle) in each of ``bins`` equal slices of
    ``[start_us, end_us]``: every engine step spreads its occupancy over the time it spans."""
    width = max(1, end_us - start_us) / bins
    out = [0.0] * bins
    for s in steps:
        lo, hi, occ = s["ts"], s["ts"] + s["dur"], s["args"]["rows"] / s["args"]["slots"]
        for i in range(max(0, int((lo - start_us) // width)), min(bins, int((hi - start_us) // width) + 1)):
            b0 = start_us + i * width
            out[i] += occ * max(0.0, min(hi, b0 + width) - max(lo, b0)) / width
    return out


def clip(spans: list[dict], lo: int, hi: int) -> list[dict]:
    """``spans`` cut to ``[lo, hi]`` (microseconds); those outside it are dropped."""
    out = []
    for s in spans:
        a, b = max(lo, s["ts"]), min(hi, s["ts"] + s["dur"])
        if b > a:
            out.append({**s, "ts": a, "dur": b - a})
    return out


def busy_times(spans: list[dict], gen_proc: str) -> tuple[float, float]:
    """``(E, T)`` seconds: the generator's busy time outside its engine steps (the union of its
    non-edge spans less the engine steps'), and the union of the non-edge spans of the other
    workers (the trainer's steps, their phases, weight publishes), less its checkpoint writes (an
    ``io`` span named ``checkpoint``: disk time, left in the loop's overhead ``O``)."""
    gen = [s for s in spans if s["proc"] == gen_proc and s["cat"] != "edge"]
    steps = sum(s["dur"] for s in gen if "rows" in s["args"]) / 1e6
    train = [s for s in spans if s["proc"] not in (gen_proc, "driver") and s["cat"] != "edge"
             and s.get("name") != "checkpoint"]
    return max(0.0, union_seconds(gen) - steps), union_seconds(train)


def loop_window(spans: list[dict], gen_proc: str, first_step_us: int) -> tuple[int, int, float]:
    """``(start, end, waited)`` of the RL loop (module doc): ``start`` the generator's first
    engine step, ``end`` the last span's end (microseconds), ``waited`` the seconds in
    ``[start, ready]`` the generator was idle, ``ready`` the latest first span of the other
    workers (their start-up; ``driver`` and the router's ``edge ...`` tracks are not workers)."""
    workers = {s["proc"] for s in spans} - {"driver", gen_proc}
    ready = max([first_step_us] + [min(s["ts"] for s in spans if s["proc"] == p) for p in workers
                                   if not p.startswith("edge ")])
    gen_spans = [s for s in spans if s["proc"] == gen_proc and s["cat"] != "edge"]
    waited = (ready - first_step_us) / 1e6 - union_seconds(clip(gen_spans, first_step_us, ready))
    return first_step_us, max(s["ts"] + s["dur"] for s in spans), waited


def analyse(summary: dict) -> dict:
    """Occupancy and busy times of one run, from its trace (``<run>/trace/*.jsonl``)."""
    spans = read_spans(Path(summary["out_dir"]))
    steps = engine_steps(spans)
    if not steps:
        raise ValueError(f"{summary['out_dir']}: no engine-step spans with rows/slots (logging.trace=false?)")
    gen_proc = steps[0]["proc"]
    start, end, waited = loop_window(spans, gen_proc, steps[0]["ts"])
    busy_us = sum(s["dur"] for s in steps)
    occ_busy = sum(s["dur"] * s["args"]["rows"] / s["args"]["slots"] for s in steps) / busy_us
    gen_other, train = busy_times(spans, gen_proc)
    return {"steps": steps, "bins": occupancy_bins(steps, start, end), "occ_busy": occ_busy,
            "occ_wall": occ_busy * busy_us / max(1, end - start), "gen_other_s": gen_other, "train_s": train,
            "loop_s": (end - start) / 1e6 - waited, "waited_s": waited, "gen_s": busy_us / 1e6 + gen_other}


def sparkline(values: list[float]) -> str:
    """One digit per value: ``floor(10 v)`` capped at 9 (0 = idle or < 10 %, 9 = >= 90 %)."""
    return "".join(str(min(9, int(10 * v))) for v in values)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=sorted(GRAPHS), default="arith")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds of all variants")
    args, rest = parser.parse_known_args(argv)
    async_k = 2
    overrides = []
    for item in rest:
        if item.startswith("async_k="):
            async_k = int(item.split("=", 1)[1])
        else:
            overrides.append(item)
    root = Path(__file__).resolve().parents[1]
    graph = GRAPHS[args.task]
    flow = load_flow(root / "graphs" / f"{graph}.py")
    variants = [("sync", 0, []), ("sync-1t", 0, ["scheduler.threads_per_worker=1"]), ("async", async_k, [])]
    if args.task == "longtail":
        variants.append(("async-nonint", async_k, ["gen.interruptible=false"]))
    loops: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    walls: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    ideals: list[float] = []
    for round_ in range(args.repeats):
        print(f"[{round_ + 1}] load average (1, 5, 15 min) {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
              f"on {os.cpu_count()} cores", flush=True)
        runs = {}
        for label, k, extra in variants:
            cfg = load_config(root / "graphs" / f"{graph}.yaml",
                              ["eval.enabled=false", f"async.max_staleness={k}", f"name=bench_{graph}_{label}",
                               *DEFAULTS.get(args.task, []), *extra, *overrides])
            summary = run_experiment(flow(cfg), cfg, show_progress=False)
            runs[label] = a = analyse(summary)
            walls[label].append(summary["wall_s"])
            loops[label].append(a["loop_s"])
            print(f"[{round_ + 1}] {label:>12} (max_staleness={k}): {summary['wall_s']:7.1f} s "
                  f"(loop {a['loop_s']:.1f} s, less {a['waited_s']:.1f} s of start-up; generator busy {a['gen_s']:.1f} s, trainer busy {a['train_s']:.1f} s) "
                  f"for {summary['samples_trained']} samples, staleness histogram {summary['staleness_histogram']}",
                  flush=True)
            print(f"    occupancy over time |{sparkline(a['bins'])}|  mean {a['occ_wall']:.0%} of the wall, "
                  f"{a['occ_busy']:.0%} of engine-busy time; slots {a['steps'][0]['args']['slots']}", flush=True)
        s, s1 = runs["sync"], runs["sync-1t"]
        i = ideal_ratio(s["loop_s"], s["gen_s"], s["train_s"], s1["steps"], s1["gen_other_s"], s1["train_s"],
                        cfg.train.steps)
        ideals.append(i["ideal_ratio"])
        print(f"[{round_ + 1}] ideal: sync G={i['G']:.1f} s, T={i['T']:.1f} s, O={i['O']:.1f} s; "
              f"one thread G1={i['G1']:.1f} s "
              f"(x{i['G1'] / i['G']:.2f}), T1={i['T1']:.1f} s (x{i['T1'] / i['T']:.2f}); {i['tokens']} tokens, "
              f"full-batch step {i['step_full_s'] * 1e3:.1f} ms -> G1_full={i['G1_full']:.1f} s (tail G1/G1_full "
              f"{i['G1'] / i['G1_full']:.2f}); ideal async loop {i['ideal_async_s']:.1f} s, ideal ratio "
              f"{i['ideal_ratio']:.2f}x; this round async {s['loop_s'] / runs['async']['loop_s']:.2f}x", flush=True)
    mean = {label: sum(v) / len(v) for label, v in walls.items()}
    loop = {label: sum(v) / len(v) for label, v in loops.items()}
    ideal = sum(ideals) / len(ideals)
    print(f"async speed-up (mean sync / mean async): loop {loop['sync'] / loop['async']:.2f}x (wall "
          f"{mean['sync'] / mean['async']:.2f}x), ideal (loop) {ideal:.2f}x, measured / ideal "
          f"{loop['sync'] / loop['async'] / ideal:.0%}")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if "async-nonint" in mean:
        print(f"interruptible generation on vs off (off / on): loop {loop['async-nonint'] / loop['async']:.2f}x (wall "
              f"{mean['async-nonint'] / mean['async']:.2f}x)")


if __name__ == "__main__":
    main(sys.argv[1:])
