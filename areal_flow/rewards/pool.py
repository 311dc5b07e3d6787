"""Calling rule reward functions safely: a thread pool with a per-call timeout, and the
failure accounting that stops a run whose reward keeps failing.

Owns: running ``fn(output_text, answer)`` for each sample of a group on daemon threads,
classifying each call as a value or a failure (the exception's type name,
``"TimeoutError"`` past ``timeout_s``, or ``"non-finite"`` for a NaN/inf/non-number), and
:class:`FailureMonitor`: failures counted per kind, logged once per kind with one example
traceback, and a :class:`FailureFractionError` when they exceed a fraction of a sliding
window of samples. Must not: know about groups, trajectories or the graph (the ``reward``
op does).

A call that times out cannot be stopped (Python threads cannot be killed): its thread is
abandoned, a fresh one takes its place, and whatever it returns later is ignored. Daemon
threads do not hold the worker process open at exit. A reward function that hangs often
thus leaks one thread per hang; the failure fraction bounds how many before the run stops.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ALL_COMPLETED, Future, wait

TIMEOUT = "TimeoutError"
NON_FINITE = "non-finite"
_QUEUED_POLL_S = 0.01  # seconds between looks while calls wait for a free thread

logger = logging.getLogger(__name__)


class FailureFractionError(RuntimeError):
    """Samples failed more often than their monitor allows (e.g. ``reward.max_failure_fraction``);
    one line: the source, the count, the kinds and the first example."""

    brief = True  # the launcher reports the message alone, without a traceback


class Outcome:
    """One call's result: ``value`` (a finite float) or ``kind`` + ``detail`` (a traceback)."""

    __slots__ = ("value", "kind", "detail")

    def __init__(self, value: float | None = None, kind: str = "", detail: str = "") -> None:
        self.value, self.kind, self.detail = value, kind, detail

    @property
    def failed(self) -> bool:
        return bool(self.kind)


class _Job:
    __slots__ = ("args", "future", "started", "abandoned")

    def __init__(self, args: tuple) -> None:
        self.args, self.future, self.started, self.abandoned = args, Future(), None, False


class RewardPool:
    """Daemon threads calling ``fn`` with a per-call timeout.

    Args:
        fn: ``fn(output_text, answer) -> float``.
        workers: threads (calls in flight at once); a group's calls are spread over them.
        timeout_s: seconds one call may run, counted from its start (not its queueing).

    Raises:
        ValueError: ``workers < 1`` or ``timeout_s <= 0``.
    """

    def __init__(self, fn: Callable[[str, str], float], workers: int = 4, timeout_s: float = 10.0) -> None:
        if workers < 1 or not timeout_s > 0:
            raise ValueError(f"RewardPool: need workers >= 1 and timeout_s > 0, got {workers} and {timeout_s}")
        self.fn, self.timeout_s = fn, timeout_s
        self.abandoned = 0  # threads left behind in a call that timed out
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        threading.Thread(target=self._work, daemon=True, name="reward-pool").start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            job.started = time.monotonic()
            try:
                job.future.set_result(self.fn(*job.args))
            except BaseException as exc:  # noqa: BLE001 - every failure of a user function is an outcome
                job.future.set_exception(exc)
            if job.abandoned:
                return  # a replacement thread took this one's place

    def map(self, calls: Sequence[tuple[str, str]]) -> list[Outcome]:
        """Run ``fn(*call)`` for every call; outcomes in call order. Never raises for ``fn``."""
        jobs = [_Job(args) for args in calls]
        for job in jobs:
            self._jobs.put(job)
        outcomes: dict[int, Outcome] = {}
        while len(outcomes) < len(jobs):
            pending = [(i, job) for i, job in enumerate(jobs) if i not in outcomes]
            starts = [job.started for _, job in pending if job.started is not None]
            # sleep until every pending call returned or the earliest started one's deadline
            budget = max(0.0, min(starts) + self.timeout_s - time.monotonic()) if starts else _QUEUED_POLL_S
            wait([job.future for _, job in pending], timeout=budget, return_when=ALL_COMPLETED)
            now = time.monotonic()
            for i, job in pending:
                if job.future.done():
                    outcomes[i] = _outcome(job.future)
                elif job.started is not None and now - job.started > self.timeout_s:
                    job.abandoned = True
                    self.abandoned += 1
                    self._spawn()
                    outcomes[i] = Outcome(kind=TIMEOUT, detail=f"call did not return within {self.timeout_s:g} s "
                                                               "(reward.timeout_s); its thread was abandoned\n")
        return [outcomes[i] for i in range(len(jobs))]


def _outcome(future: Future) -> Outcome:
    exc = future.exception()
    if exc is not None:
        return Outcome(kind=type(exc).__name__,
                       detail="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    value = future.result()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return Outcome(kind=NON_FINITE, detail=f"returned {value!r:.80}, not a finite number\n")
    return Outcome(value=float(value))


class FailureMonitor:
    """Counts failed samples per kind, logs the first of each kind, and stops the run when
    more than ``max_fraction`` of the last ``window`` samples failed.

    The test is ``failures among the last window samples > max_fraction * window``, so a
    reward that always fails stops the run after ``floor(max_fraction * window) + 1``
    samples, however early, and a short run with a few failures never does.

    Args:
        what: names the source in messages (e.g. ``"reward node 'reward' (fn arithmetic)"``).
        max_fraction: in ``(0, 1]``; 1 never stops.
        window: samples in the sliding window (>= 1).

    Attributes:
        kinds: failures so far per kind (whole run). samples: samples recorded so far.
    """

    def __init__(self, what: str, max_fraction: float = 0.5, window: int = 200) -> None:
        if not 0 < max_fraction <= 1 or window < 1:
            raise ValueError(f"{what}: need 0 < max_failure_fraction <= 1 and failure_window >= 1, "
                             f"got {max_fraction} and {window}")
        self.what, self.max_fraction, self.window = what, max_fraction, window
        self.kinds: Counter[str] = Counter()
        self.samples = 0
        self._recent: deque[bool] = deque(maxlen=window)
        self._first: str = ""

    def record(self, outcome: Outcome, sample_id: str) -> None:
        """Account one sample's outcome.

        Raises:
            FailureFractionError: the window's failures exceed ``max_fraction * window``.
        """
        self.samples += 1
        self._recent.append(outcome.failed)
        if outcome.failed:
            if not self.kinds[outcome.kind]:
                first_line = outcome.detail.strip().splitlines()[-1] if outcome.detail.strip() else outcome.kind
                self._first = self._first or f"sample {sample_id}: {first_line}"
                logger.error("%s: %s on sample %s (first of its kind; later ones are only counted):\n%s",
                             self.what, outcome.kind, sample_id, outcome.detail.rstrip())
            self.kinds[outcome.kind] += 1
        failures = sum(self._recent)
        if failures > self.max_fraction * self.window:
            kinds = ", ".join(f"{k} x{n}" for k, n in self.kinds.most_common())
            raise FailureFractionError(f"{self.what}: {failures} of the last {len(self._recent)} samples failed "
                                     f"(> max_failure_fraction {self.max_fraction:g} of a window of {self.window}); "
                                     f"so far {kinds}; first: {self._first}")
