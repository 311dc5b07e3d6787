"""Decode cost of one generation replica, and its continuous batch.

Owns :class:`DecodeCost` (seconds of one decode step as a function of the live batch and
its total context) and :class:`ContinuousBatch` (a replica that admits responses into free
slots as others finish, no waves) and :class:`DrainSchedule` (the runs of a batch that
drains, for the synchronous step: integers shared by every replica shape, costed at once
with numpy by :func:`drain_s`). The compiler's closed forms (``compiler.timing``) and
the simulator (``compiler.simulate``) both use them, so the two agree by construction.

One decode step of a replica with ``b`` live responses holding ``S`` context tokens in all
(Pope et al. 2022, "Efficiently Scaling Transformer Inference", section 2; Kwon et al.
2023, vLLM, section 2.3 on continuous batching):

    t(b, S) = o + tp_comm(b) + pp_hop(b)
              + max((W(b) + kv * S) / (tp * HBM), (2 N_act b + 2 L d_attn S) / (tp * peak * MFU))

- ``W(b)``: weight bytes read once per step; for MoE the dense part plus the share of
  routed experts a batch touches, ``min(1, b k / E)``;
- ``kv``: K and V bytes per context token (``2 L g d`` elements); every live token's cache
  is read once per step;
- ``2 N_act`` FLOPs per new token and ``2 L d_attn`` per (new token, context token) pair
  (Kaplan et al. 2020, Table 1);
- ``tp_comm(b) = 2 L`` ring all-reduces of ``b h`` activations; ``pp_hop(b) = (pp - 1)``
  point-to-point sends of ``b h`` activations (stages run one after the other);
- ``o``: ``compile.decode_step_overhead_s``, ASSUMED fixed seconds per step (scheduler,
  sampling, launches). Its range, from published figures for Llama-3-8B on one H100: the
  GPU part of a decode step is ~5 ms (vLLM V1 blog, Jan 2025, sec. 1); before v0.6.0 the
  step's time was 38 % GPU execution, 29 % scheduling and input preparation and 33 % the
  HTTP server (vLLM v0.6.0 blog, Sept 2024, "Performance Diagnosis"), so an offline
  engine's CPU side was ~29/38 x 5 ms ~ 3.8 ms; v0.6.0's multi-step scheduling and
  asynchronous output processing hide part of it (0 ms if all). The 2 ms default lies in
  that 0-3.8 ms range; docs/SIMULATE.md gives the simulated ratios at 0 and 4 ms.

Between two events of a replica (a response finishing, a response admitted) ``b`` is
constant and ``S`` grows by ``b`` per step, so both arguments of the max are linear in the
step index and a run of ``n`` steps sums in closed form (:meth:`DecodeCost.run_s`).
Prefill: ``P (2 N_act + 2 L P d_attn)`` FLOPs per prompt, compute-bound, a group's prompt once
for its ``n`` responses (``samples_per_prompt``: the engines share it).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from compiler.memory import DTYPE_BYTES
from compiler.models import ModelSpec
from compiler.strategy import ParallelStrategy

_PHI = (math.sqrt(5) - 1) / 2


def _series(x0: float, x1: float, a: int, b: int) -> float:
    """``sum(x0 + x1 * j for j in range(a, b))``."""
    n = b - a
    return 0.0 if n <= 0 else n * x0 + x1 * (a + b - 1) * n / 2


@dataclass(frozen=True)
class DecodeCost:
    """Seconds of decode steps and prefills of one replica (see the module docstring).

    Attributes:
        dense_bytes: weight bytes every step reads (non-expert), per replica.
        expert_bytes: routed-expert weight bytes, per replica (0 for dense models).
        expert_share: ``k / E``, the share of experts one token uses.
        kv_bytes: KV-cache bytes per context token, summed over the replica's TP ranks (KV
            heads replicated when ``tp > g``).
        bandwidth: ``tp * HBM`` bytes/s.
        compute: ``tp * peak * MFU`` FLOP/s.
        flops_token: ``2 N_act`` FLOPs per new token.
        flops_ctx: ``2 L d_attn`` FLOPs per (new token, context token).
        comm_fixed / comm_per_seq: seconds of TP all-reduces and PP hops per step, constant
            part and per live response.
        overhead_s: fixed seconds per step.
        prompt_len: prompt tokens of every response.
        samples_per_prompt: responses that share one prompt (a GRPO group), prefilled once for
            all of them (the embedded engine copies a group's prompt cache from a row that holds
            it, ``runtime.engines.generation``; vLLM's prefix caching shares whole blocks of 16
            tokens, so a shorter prompt is prefilled per response there: an ASSUMPTION that
            under-counts vLLM's prefill of short prompts); 1 = a prompt per response.
    """

    dense_bytes: float
    expert_bytes: float
    expert_share: float
    kv_bytes: float
    bandwidth: float
    compute: float
    flops_token: float
    flops_ctx: float
    comm_fixed: float
    comm_per_seq: float
    overhead_s: float
    prompt_len: int
    samples_per_prompt: int = 1

    @classmethod
    def build(cls, model: ModelSpec, s: ParallelStrategy, *, dtype: str, mfu: float, links, overhead_s: float,
              prompt_len: int, samples_per_prompt: int = 1) -> "DecodeCost":
        """The cost of a replica of ``s.tp * s.pp`` devices (``links``: ``compiler.timing.Links``)."""
        b = DTYPE_BYTES[dtype]
        act = model.hidden * b  # one response's activations between layers, bytes
        ring = 2 * (s.tp - 1) / s.tp if s.tp > 1 else 0.0
        tp_calls = 2 * model.n_layers if s.tp > 1 else 0
        return cls(
            dense_bytes=b * (model.n_params - model.n_expert_params),
            expert_bytes=b * model.n_expert_params,
            expert_share=model.experts_per_token / model.n_experts if model.is_moe else 0.0,
            kv_bytes=b * model.kv_elements_per_token() * s.tp / min(s.tp, model.n_kv_heads),  # replicated heads
            bandwidth=s.tp * links.hbm,
            compute=s.tp * links.device.peak_flops * mfu,
            flops_token=2 * model.n_active_params,
            flops_ctx=2 * model.n_layers * model.n_heads * model.head_dim,
            comm_fixed=(tp_calls + s.pp - 1) * links.latency,
            comm_per_seq=tp_calls * ring * act / links.intra + (s.pp - 1) * act / links.intra,
            overhead_s=overhead_s,
            prompt_len=prompt_len,
            samples_per_prompt=samples_per_prompt,
        )

    def _lines(self, b: int, s0: float) -> tuple[float, float, float, float, float]:
        weights = self.dense_bytes + self.expert_bytes * min(1.0, b * self.expert_share)
        mem0, mem1 = (weights + self.kv_bytes * s0) / self.bandwidth, self.kv_bytes * b / self.bandwidth
        cmp0 = (self.flops_token * b + self.flops_ctx * s0) / self.compute
        cmp1 = self.flops_ctx * b / self.compute
        return mem0, mem1, cmp0, cmp1, self.overhead_s + self.comm_fixed + self.comm_per_seq * b

    def step_s(self, b: int, context: float) -> float:
        """Seconds of one step with ``b`` live responses holding ``context`` tokens in all."""
        mem0, _, cmp0, _, fixed = self._lines(b, context)
        return fixed + max(mem0, cmp0)

    def run_s(self, b: int, context: float, n: int) -> float:
        """Seconds of ``n`` steps at batch ``b`` starting from ``context`` tokens (``+b`` per step)."""
        if n <= 0 or b <= 0:
            return 0.0
        mem0, mem1, cmp0, cmp1, fixed = self._lines(b, context)
        (h0, h1), (l0, l1) = ((mem0, mem1), (cmp0, cmp1)) if mem0 >= cmp0 else ((cmp0, cmp1), (mem0, mem1))
        # the line larger at j = 0 stays larger while j <= (h0 - l0) / (l1 - h1)
        cross = n if h1 >= l1 else min(n, math.floor((h0 - l0) / (l1 - h1)) + 1)
        return n * fixed + _series(h0, h1, 0, cross) + _series(l0, l1, cross, n)

    def runs_s(self, b: np.ndarray, context: np.ndarray, n: np.ndarray) -> np.ndarray:
        """:meth:`run_s` of many runs at once, shape ``(runs,)`` each (``b >= 1``, ``n >= 1``):
        the same float operations in the same order, so each element equals ``run_s``."""
        weights = self.dense_bytes + self.expert_bytes * np.minimum(1.0, b * self.expert_share)
        mem0, mem1 = (weights + self.kv_bytes * context) / self.bandwidth, self.kv_bytes * b / self.bandwidth
        cmp0 = (self.flops_token * b + self.flops_ctx * context) / self.compute
        cmp1 = self.flops_ctx * b / self.compute
        fixed = self.overhead_s + self.comm_fixed + self.comm_per_seq * b
        mem_high = mem0 >= cmp0
        h0, h1 = np.where(mem_high, mem0, cmp0), np.where(mem_high, mem1, cmp1)
        l0, l1 = np.where(mem_high, cmp0, mem0), np.where(mem_high, cmp1, mem1)
        with np.errstate(divide="ignore", invalid="ignore"):  # lanes with h1 >= l1 take n
            meet = np.floor((h0 - l0) / (l1 - h1)) + 1
        cross = np.where(h1 >= l1, n, np.minimum(n, np.where(h1 >= l1, 0, meet))).astype(np.int64)
        rest = n - cross
        high = np.where(cross > 0, cross * h0 + h1 * (cross - 1) * cross / 2, 0.0)
        low = np.where(rest > 0, rest * l0 + l1 * (cross + n - 1) * rest / 2, 0.0)
        return n * fixed + high + low

    def steps_within(self, b: int, context: float, seconds: float, most: int) -> int:
        """Most steps (<= ``most``) that fit in ``seconds`` at batch ``b`` from ``context``."""
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.run_s(b, context, mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def prefill_s(self, responses: int = 1) -> float:
        """Seconds to prefill the prompts of ``responses`` responses, each prompt once for its
        ``samples_per_prompt`` responses."""
        p = self.prompt_len
        return responses / self.samples_per_prompt * p * (self.flops_token + self.flops_ctx * p) / self.compute


class ContinuousBatch:
    """One replica's engine: ``slots`` responses decode together; a finished one frees its
    slot for the next queued response at once (continuous batching, no waves).

    ``clock`` is the replica's time in seconds; ``busy_s`` the seconds it decoded or
    prefilled; ``occupancy_s`` the integral of live responses over busy time.
    """

    def __init__(self, cost: DecodeCost, slots: int):
        self.cost, self.slots = cost, max(1, slots)
        self.clock = self.busy_s = self.occupancy_s = 0.0
        self.steps = 0  # decode steps taken so far
        self._live: list[tuple[int, int, int]] = []  # (step at which it finishes, response id, start step)
        self._starts = 0  # sum of the live responses' start steps
        self._queue: deque[tuple[int, int]] = deque()

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def idle(self) -> bool:
        return not self._live and not self._queue

    def add(self, length: int, rid: int) -> None:
        """Queue response ``rid`` of ``length`` tokens."""
        self._queue.append((length, rid))

    def _context(self) -> float:
        return len(self._live) * (self.cost.prompt_len + self.steps) - self._starts

    def _admit(self) -> None:
        if not self._queue or len(self._live) >= self.slots:
            return
        n = 0
        while self._queue and len(self._live) < self.slots:
            length, rid = self._queue.popleft()
            heapq.heappush(self._live, (self.steps + length, rid, self.steps))
            self._starts += self.steps
            n += 1
        dt = self.cost.prefill_s(n)
        self.clock += dt
        self.busy_s += dt

    def next_finish(self) -> float:
        """Time at which the next response finishes if nothing interrupts (queued responses
        are admitted first, at the current clock); ``inf`` when nothing is live."""
        self._admit()
        if not self._live:
            return math.inf
        return self.clock + self.cost.run_s(len(self._live), self._context(), self._live[0][0] - self.steps)

    def wait_until(self, t: float) -> None:
        """Idle (or paused) until time ``t``."""
        self.clock = max(self.clock, t)

    def advance(self, until: float = math.inf) -> list[int]:
        """Decode up to the next finishing response or to time ``until``, whichever is first.

        Returns:
            ids of the responses that finished (empty if ``until`` came first or nothing is live).
        """
        self._admit()
        if not self._live or self.clock >= until:
            return []
        b, context = len(self._live), self._context()
        n = self._live[0][0] - self.steps
        dt = self.cost.run_s(b, context, n)
        if self.clock + dt > until:
            n = self.cost.steps_within(b, context, until - self.clock, n)
            dt = self.cost.run_s(b, context, n)
        self.steps += n
        self.clock += dt
        self.busy_s += dt
        self.occupancy_s += b * dt
        done = []
        while self._live and self._live[0][0] <= self.steps:
            _, rid, start = heapq.heappop(self._live)
            self._starts -= start
            done.append(rid)
        return done


@dataclass(frozen=True, eq=False)
class DrainSchedule:
    """The runs of one replica draining a batch of responses queued at time 0: between two
    events (a response finishing, the next one admitted) the live batch is constant. Pure
    integers, independent of the replica's shape, so one schedule serves every ``(tp, pp)``.

    Attributes:
        responses: responses in the batch (each prefilled once).
        batch: live responses during each run, shape ``(runs,)``.
        age: context tokens beyond the prompts at each run's start (the live responses'
            generated tokens), shape ``(runs,)``.
        steps: decode steps in each run (>= 1), shape ``(runs,)``.
    """

    responses: int
    batch: np.ndarray
    age: np.ndarray
    steps: np.ndarray

    @classmethod
    def of(cls, lengths: tuple[int, ...], slots: int) -> "DrainSchedule":
        """:class:`ContinuousBatch`'s events for ``lengths`` (tokens) in ``slots`` KV slots.
        The admission order interleaves short and long responses by a golden-ratio shuffle,
        as random arrival would; with ``slots >= len(lengths)`` every response starts at
        step 0 and the runs end at the distinct lengths."""
        slots = max(1, slots)
        if slots >= len(lengths):
            ends, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
            starts = np.concatenate(([0], ends))[:-1]
            batch = len(lengths) - np.concatenate(([0], np.cumsum(counts)))[:-1]
            keep = ends > starts
            return cls(len(lengths), batch[keep], (batch * starts)[keep], (ends - starts)[keep])
        queue = [lengths[i] for i in sorted(range(len(lengths)), key=lambda i: (i * _PHI) % 1.0)]
        live = sorted((length, 0) for length in queue[:slots])  # (finish step, start step)
        nxt, step, started = slots, 0, 0
        runs = []
        while live:
            b, finish = len(live), live[0][0]
            if finish > step:
                runs.append((b, b * step - started, finish - step))
            step = finish
            while live and live[0][0] == step:
                started -= heapq.heappop(live)[1]
                if nxt < len(queue):
                    heapq.heappush(live, (step + queue[nxt], step))
                    started += step
                    nxt += 1
        b, age, n = np.array(runs, dtype=np.int64).reshape(-1, 3).T
        return cls(len(lengths), b, age, n)


def drain_s(cost: DecodeCost, lengths: tuple[int, ...], slots: int, schedule: DrainSchedule | None = None) -> float:
    """Seconds for one replica to generate ``lengths`` (all queued at time 0, prefills
    included): :class:`ContinuousBatch`'s arithmetic over :class:`DrainSchedule` (pass
    ``schedule``, that of ``(lengths, slots)``, to reuse it across replica shapes), its runs
    costed at once by :meth:`DecodeCost.runs_s` and summed in event order, so the result is
    bit-identical to stepping the runs one by one with :meth:`DecodeCost.run_s`."""
    if schedule is None:
        schedule = DrainSchedule.of(lengths, slots)
    runs = cost.runs_s(schedule.batch, schedule.batch * cost.prompt_len + schedule.age, schedule.steps)
    return float(np.add.accumulate(np.concatenate(([cost.prefill_s(schedule.responses)], runs)))[-1])
