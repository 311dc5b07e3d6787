"""Discrete-event simulation of the runtime over a plan (``areal-flow simulate plan.json``).

Owns :func:`simulate` and :func:`format_report`. It replays what ``runtime/`` does with a
plan, on the plan's own cost figures, and reports the steady-state step time, each node's
busy fraction, generator occupancy and bubbles, for the plan's staleness bound ``k`` and
for ``k = 0`` (the synchronous baseline on the same placement), hence the async/sync ratio.

What is simulated (names are the plan's node names, so a run's measured timeline can be
laid over the spans):

- **admission** (``runtime/staleness.py``): group ``i`` may start while
  ``i < (k + v + 1) * B``, ``v`` the version the replicas have loaded; the router sends it
  to the replica with the fewest groups in flight (``runtime/router.py``);
- **generation**: each of the generate node's ``dp`` replicas is a
  :class:`~compiler.decode.ContinuousBatch` with the plan's ``c`` slots; the ``n`` responses
  of a group draw their lengths from the plan's ``workload.length_dist`` (seeded); a group
  is delivered when its last response ends (group-grain nodes on the generator, e.g. a rule
  reward, cost nothing);
- **training**: step ``s`` starts once the ``B`` groups ``[sB, (s+1)B)`` have arrived and
  the previous step's weights are out; its training-side nodes run in plan order, each for
  its planned seconds scaled by the batch's tokens over the expected tokens (``dp_comm`` and
  ``swap`` do not scale);
- **weight sync**: ``sync_weights`` takes the plan's ``sync_s`` after each step; the
  replicas pause for it (interruptible update: in-flight responses resume afterwards; the
  KV recomputation is not charged) and then hold version ``s + 1``;
- **colocation**: when generation and training share a mesh, replicas pause while the
  trainer trains (one lock per mesh).

Event loop: a heap of ``(time, order, kind, arg)`` (``heapq``); a replica's pending
"next response finishes" event is dropped when an interruption changes its schedule (an
epoch counter). Step time is the mean interval between weight loads after ``warmup`` steps.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass

from areal_flow.config_compile import LengthDistConfig
from compiler.decode import ContinuousBatch, DecodeCost
from compiler.hardware import DeviceSpec
from compiler.lengths import LengthDist
from compiler.models import resolve_model
from compiler.plan import Plan
from compiler.timing import Links

FIXED_PARTS = ("dp_comm", "swap")  # training-time parts that do not grow with the batch's tokens


class SimulationError(ValueError):
    """The plan cannot be simulated (no generate node, no workload); the message says why."""


@dataclass(frozen=True)
class Span:
    """One busy interval: ``node`` (a plan node name) on ``worker`` (``replica3``, ``trainer``)
    from ``start`` to ``end`` seconds; ``live``: mean live responses (generation)."""

    node: str
    worker: str
    start: float
    end: float
    live: float = 0.0


@dataclass(frozen=True)
class SimResult:
    """Steady state of one simulated run.

    Attributes:
        k: staleness bound simulated.
        steps / warmup: train steps simulated / left out of the averages.
        step_time_s: mean seconds between weight loads after warm-up.
        busy: node -> busy fraction of its devices over the window (generate: mean over replicas).
        occupancy: generator time-average live responses / slots over the window.
        bubbles: ``generate`` (replica idle) and ``trainer`` (training mesh idle) fractions.
        spans: every busy interval, for timelines.
    """

    k: int
    steps: int
    warmup: int
    step_time_s: float
    busy: dict
    occupancy: float
    bubbles: dict
    spans: tuple[Span, ...]


class _Run:
    def __init__(self, plan: Plan, k: int, steps: int, seed: int, decode_cost: DecodeCost | None = None):
        w = plan.workload
        if not w:
            raise SimulationError(f"plan {plan.id} has no 'workload' (written before the simulator): compile it again")
        gens = [n for n in plan.nodes if n.role == "generation"]
        if not gens:
            raise SimulationError(f"plan {plan.id} has no generation node to simulate")
        self.gen = gens[0]
        self.train_nodes = [n for n in plan.nodes if n.role in ("training", "inference")]
        self.sync_name = next((n.name for n in plan.nodes if n.grain == "route"), "sync_weights")  # as runs name it
        spec = plan.models[self.gen.model]["spec"]
        links = Links(DeviceSpec(**plan.device), plan.cluster["n_gpus_per_node"], w["bandwidth_efficiency"])
        cost = decode_cost or DecodeCost.build(resolve_model(spec), self.gen.parallel, dtype=w["dtype"], mfu=w["mfu"],
                                               links=links, overhead_s=w["decode_step_overhead_s"],
                                               prompt_len=w["prompt_len"], samples_per_prompt=w["samples_per_prompt"])
        self.dist = LengthDist(LengthDistConfig(**w["length_dist"]), w["new_tokens"])
        self.expected_tokens = w["n_sequences"] * (w["prompt_len"] + self.dist.mean)
        self.prompt_len, self.n, self.B = w["prompt_len"], w["samples_per_prompt"], plan.batch_groups
        self.k, self.steps, self.rng = k, steps, random.Random(seed)
        self.colocated, self.sync_s = plan.colocated, plan.sync_s
        self.engines = [ContinuousBatch(cost, self.gen.concurrent or 1) for _ in range(self.gen.parallel.dp)]
        self.epoch = [0] * len(self.engines)
        self.in_flight = [0] * len(self.engines)
        self.left: dict[int, int] = {}  # group -> responses still generating
        self.tokens: dict[int, int] = {}  # train step -> tokens of its groups
        self.arrived: dict[int, int] = {}  # train step -> groups delivered
        self.admitted = self.version = self.next_step = 0
        self.training = False
        self.loads: list[float] = []  # time weights of version s + 1 were loaded
        self.spans: list[Span] = []
        self.heap: list = []
        self.order = 0

    # -- events ---------------------------------------------------------------------
    def push(self, t: float, kind: str, arg) -> None:
        self.order += 1
        heapq.heappush(self.heap, (t, self.order, kind, arg))

    def run(self) -> None:
        self.admit(0.0)
        while self.heap and len(self.loads) < self.steps:
            t, _, kind, arg = heapq.heappop(self.heap)
            if kind == "finish":
                r, epoch = arg
                if epoch == self.epoch[r]:
                    self.finished(r, self._run(r, math.inf))
                    self.reschedule(r)
            elif kind == "trained":
                self.trained(t)
            else:  # "loaded"
                self.loaded(t)

    # -- generation ----------------------------------------------------------------
    def _run(self, r: int, until: float) -> list[int]:
        engine = self.engines[r]
        before, live_s = engine.clock, engine.occupancy_s
        done = engine.advance(until)
        if engine.clock > before:
            self.spans.append(Span(self.gen.name, f"replica{r}", before, engine.clock,
                                   (engine.occupancy_s - live_s) / (engine.clock - before)))
        return done

    def reschedule(self, r: int) -> None:
        self.epoch[r] += 1
        engine = self.engines[r]
        before = engine.clock
        t = engine.next_finish()  # admits queued responses (their prefill moves the clock)
        if engine.clock > before:
            self.spans.append(Span(self.gen.name, f"replica{r}", before, engine.clock))
        if t < math.inf:
            self.push(t, "finish", (r, self.epoch[r]))

    def catch_up(self, r: int, t: float) -> None:
        """Bring replica ``r`` to time ``t`` (decoding what fits before it)."""
        engine = self.engines[r]
        if engine.live:
            self.finished(r, self._run(r, t))
        engine.wait_until(t)

    def admit(self, t: float) -> None:
        cap = (self.k + self.version + 1) * self.B
        touched = set()
        while self.admitted < cap:
            g, r = self.admitted, min(range(len(self.engines)), key=lambda i: (self.in_flight[i], i))
            if r not in touched:
                self.catch_up(r, t)
                touched.add(r)
            lengths = self.dist.sample(self.rng, self.n)
            self.left[g] = self.n
            step = g // self.B
            self.tokens[step] = self.tokens.get(step, 0) + sum(lengths) + self.n * self.prompt_len
            for j, length in enumerate(lengths):
                self.engines[r].add(length, g * self.n + j)
            self.in_flight[r] += 1
            self.admitted += 1
        for r in touched:
            self.reschedule(r)

    def finished(self, r: int, responses: list[int]) -> None:
        t = self.engines[r].clock
        for rid in responses:
            g = rid // self.n
            self.left[g] -= 1
            if self.left[g] == 0:
                self.in_flight[r] -= 1
                step = g // self.B
                self.arrived[step] = self.arrived.get(step, 0) + 1
                if step == self.next_step and self.arrived[step] == self.B:
                    self.start_training(t)

    def pause_replicas(self, start: float, end: float) -> None:
        for r, engine in enumerate(self.engines):
            self.catch_up(r, start)
            engine.wait_until(end)
            self.reschedule(r)

    # -- training and weight sync ---------------------------------------------------
    def start_training(self, t: float) -> None:
        if self.training or self.arrived.get(self.next_step, 0) < self.B:
            return
        self.training = True
        scale = self.tokens[self.next_step] / self.expected_tokens
        clock = t
        for node in self.train_nodes:
            seconds = sum(v if part in FIXED_PARTS else v * scale for part, v in node.times.items())
            self.spans.append(Span(node.name, "trainer", clock, clock + seconds))
            clock += seconds
        if self.colocated:
            self.pause_replicas(t, clock + self.sync_s)
        self.push(clock, "trained", None)

    def trained(self, t: float) -> None:
        self.spans.append(Span(self.sync_name, "trainer", t, t + self.sync_s))
        if not self.colocated:
            self.pause_replicas(t, t + self.sync_s)
        self.push(t + self.sync_s, "loaded", None)

    def loaded(self, t: float) -> None:
        self.loads.append(t)
        self.version += 1
        self.next_step += 1
        self.training = False
        if len(self.loads) < self.steps:
            self.admit(t)
            self.start_training(t)


def _overlap(spans, lo: float, hi: float) -> tuple[float, float]:
    """Seconds of ``spans`` inside ``[lo, hi]`` and their live-response integral."""
    busy = live = 0.0
    for s in spans:
        inside = max(0.0, min(s.end, hi) - max(s.start, lo))
        busy += inside
        live += inside * s.live
    return busy, live


def simulate(plan: Plan, k: int | None = None, steps: int = 8, seed: int = 0,
             decode_cost: DecodeCost | None = None) -> SimResult:
    """Simulate ``steps`` train steps of ``plan`` with staleness bound ``k`` (default: the plan's).

    ``decode_cost``: the replicas' decode cost instead of the one built from the plan's model
    and device (``runtime.calibrate`` passes one measured on a run).

    Raises:
        SimulationError: the plan has no generation node or no workload; ``steps < 2``.
    """
    if steps < 2:
        raise SimulationError(f"steps={steps}: need at least 2 train steps")
    k = plan.staleness_bound if k is None else k
    run = _Run(plan, k, steps, seed, decode_cost)
    run.run()
    warmup = max(1, steps // 4)
    lo, hi = run.loads[warmup - 1], run.loads[-1]
    window = hi - lo
    replicas = len(run.engines)
    busy, live_total = {}, 0.0
    for name in [run.gen.name, *(n.name for n in run.train_nodes), run.sync_name]:
        seconds, live = _overlap([s for s in run.spans if s.node == name], lo, hi)
        busy[name] = seconds / (window * (replicas if name == run.gen.name else 1))
        live_total += live if name == run.gen.name else 0.0
    trainer_busy = sum(v for name, v in busy.items() if name != run.gen.name)
    return SimResult(
        k=k, steps=steps, warmup=warmup, step_time_s=window / (steps - warmup), busy=busy,
        occupancy=live_total / (window * replicas * run.engines[0].slots),
        bubbles={"generate": 1 - busy[run.gen.name], "trainer": 1 - trainer_busy}, spans=tuple(run.spans),
    )


def format_report(plan: Plan, results: list[SimResult]) -> str:
    """The table ``areal-flow simulate`` prints: one row per simulated k, then the ratio."""
    w = plan.workload
    d = w["length_dist"]
    shape = {"fixed": f"fixed {d['mean']}", "uniform": f"uniform [{d['low']}, {d['high']}]",
             "lognormal": f"lognormal mean {d['mean']} sigma {d['sigma']}"}[d["kind"]]
    lines = [
        f"simulated plan {plan.id}: {plan.allocation}",
        f"{plan.batch_groups} prompts x {w['samples_per_prompt']} responses per step, lengths {shape} of "
        f"{w['new_tokens']} tokens; {results[0].steps} steps ({results[0].warmup} warm-up left out)",
        "",
        f"{'k':>3}  {'step time':>10}  {'gen busy':>8}  {'occupancy':>9}  {'train busy':>10}  {'gen bubble':>10}  "
        f"{'train bubble':>12}",
    ]
    for r in results:
        train = 1 - r.bubbles["trainer"]
        lines.append(f"{r.k:>3}  {r.step_time_s:>8.2f} s  {1 - r.bubbles['generate']:>8.1%}  {r.occupancy:>9.1%}  "
                     f"{train:>10.1%}  {r.bubbles['generate']:>10.1%}  {r.bubbles['trainer']:>12.1%}")
    lines.append("busy by node: " + "; ".join(
        f"k={r.k}: " + ", ".join(f"{node} {frac:.1%}" for node, frac in r.busy.items()) for r in results))
    sync = next((r for r in results if r.k == 0), None)
    for r in results:
        if sync is not None and r.k > 0:
            lines.append(f"async (k={r.k}) / sync (k=0) = {sync.step_time_s / r.step_time_s:.2f}x")
    lines.append(f"the compiler predicted {plan.step_time_s:.2f} s per step for k={plan.max_staleness}")
    return "\n".join(lines)


def spans_json(result: SimResult) -> list[dict]:
    """The spans as plain dicts (``areal-flow simulate --trace``)."""
    return [asdict(s) for s in result.spans]
