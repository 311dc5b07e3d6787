"""The driver of a run: the logic every scheduler shares around its workers, written once.

Owns :class:`Driver`, which runs a plan's workers through a :class:`Scheduler` (the
``local`` one of ``runtime.launch``: OS processes; the ``ray`` one of
``runtime.ray_scheduler``: actors in placement groups) and decides, the same way for both:

* the attempt loop (``runtime.restarts.run_attempts``): each attempt gets addresses from the
  scheduler, builds the workers' specs and the router (``runtime.run_setup``), starts every
  worker, and runs until every step group (:func:`run_ends`: the trainer's, a critic's on a
  mesh of its own, ...) reports; then the router tells the replicas to stop and their reports are collected;
* what a worker's end means: a report is kept; an error stops the run
  (:class:`~runtime.restarts.WorkerFailed` with its traceback); a dead generation replica is
  started again at the router's version for it, waiting for the trainer's republished weights
  (``resync``) and getting its groups again under their indices; a dead stage worker
  (:class:`~runtime.restarts.StageDied`), or a replica whose host is gone
  (:class:`~runtime.restarts.HostLost`), restarts every worker from the last checkpoint;
* the step metrics (logged as they arrive, and before any exception leaves an attempt), the
  stop (every worker of the attempt ended, on success and on failure; after a stage's death
  or Ctrl-C before the metrics are logged, so no checkpoint follows the one a resume uses)
  and the summary (``RunSetup.finish`` with the restarts and the scheduler's own block).

How a worker is hosted, how its end is noticed and how metrics travel is the scheduler's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from areal_flow.ops.registry import GENERATION
from runtime.metrics import RunLogger
from runtime.restarts import HostLost, ReportsLost, Restarts, StageDied, WorkerFailed, run_attempts
from runtime.run_setup import RunSetup
from runtime.topology import Topology, WorkerGroup
from runtime.workers import WorkerSpec

POLL_S = 0.2
"""Seconds the driver waits for a worker's end before it logs metrics again."""
REPORT_WAIT_S = 10.0
"""Seconds to wait for each replica's report once the trainer is done (then it is left out)."""
OK, ERROR, DIED = "ok", "error", "died"


@dataclass(frozen=True)
class WorkerEnd:
    """A worker that ended: ``name`` (``<group>/<rank>``); ``status`` ok (``payload``: its
    report), error (``payload``: the exception and traceback) or died (``payload``: why, e.g.
    ``exit code -9``)."""

    name: str
    status: str
    payload: Any


@runtime_checkable
class Scheduler(Protocol):
    """How one backend hosts the workers of an attempt (local processes, Ray actors).

    Attributes:
        restart_how: how a dead replica comes back, for the console (``restarting it``).
        start_how: what the console says while an attempt's workers start, ``{n}`` their number
            (``starting {n} workers (torch, models)``).
    """

    restart_how: str
    start_how: str

    def addresses(self) -> tuple[dict[str, list[str]], str, int]:
        """Ready a new attempt: ``(inbox addresses by group name, plus "weights": the
        replicas' weight channels; the router's control address; torch threads per worker)``.

        Raises:
            runtime.ray_cluster.ClusterMismatchError: workers that cannot reach each other.
        """

    def start(self, spec: WorkerSpec, group: WorkerGroup) -> None:
        """Start the worker ``spec`` describes (again, after a death) in ``group``."""

    def wait(self, timeout_s: float) -> list[WorkerEnd]:
        """The workers that ended since the last call, waiting up to ``timeout_s`` for one
        (a dead one is reported until it is started again)."""

    def metrics(self) -> list[dict]:
        """The step metrics the trainer reported since the last call, in order."""

    def revive(self, name: str, cause: str) -> None:
        """Make dead replica ``name``'s host ready for :meth:`start`.

        Raises:
            HostLost: its host is gone (a lost node): every worker restarts from the last
                checkpoint, on the hosts that remain.
            WorkerFailed: it cannot be (named, with ``cause``).
        """

    def stop(self, wait: bool) -> None:
        """End every worker of the attempt (idempotent); with ``wait``, until they are gone."""

    def release(self) -> dict:
        """Free what the run holds; the scheduler's entries for the summary (may be empty)."""


def reports(topo: Topology, group: WorkerGroup) -> bool:
    """True for the one worker group whose worker reports the step metrics, under every
    scheduler: the trainer's (:attr:`Topology.trainer`; a critic's step group on a mesh of
    its own passes its stats on with the step's batch instead)."""
    return group.name == topo.trainer.name


def run_ends(topo: Topology) -> set[str]:
    """The workers (``<group>/0``) whose ends end the run, under every scheduler: one per
    step group (:attr:`Topology.step_groups`), so no step group is stopped mid-step."""
    return {f"{g.name}/0" for g in topo.step_groups}


class Driver:
    """Runs ``setup``'s plan on ``scheduler`` (module doc); :meth:`execute` returns the summary."""

    def __init__(self, setup: RunSetup, scheduler: Scheduler) -> None:
        self.setup, self.scheduler = setup, scheduler
        self.restarts = Restarts.for_run(setup)
        self.router = None

    def execute(self) -> dict:
        """Every attempt until one ends; the trace merged either way.

        Raises:
            WorkerFailed: a worker raised, or workers died beyond ``scheduler.max_restarts``.
            KeyboardInterrupt: Ctrl-C (after the workers stopped).
        """
        try:
            logger, workers = run_attempts(self.setup, self.restarts, self._attempt)
        finally:
            self.setup.merge_trace()
        extra = self.scheduler.release()  # free the cluster before the held-out evaluation
        return self.setup.finish(logger, workers, restarts=self.restarts.block(workers), **extra)

    def _attempt(self, logger: RunLogger) -> dict:
        """Start every worker (from :attr:`RunSetup.checkpoint` when set), run to the end,
        return the workers' reports. Raises StageDied when a stage worker died."""
        setup, topo = self.setup, self.setup.topo
        addresses, control, threads = self.scheduler.addresses()
        specs = setup.specs(addresses, control, threads)
        router = self.router = setup.router(addresses[topo.generation.name], control)
        stop = threading.Event()
        router_thread = threading.Thread(target=router.run, args=(stop,), daemon=True)
        router_thread.start()

        def stop_router() -> None:
            stop.set()  # the router tells the replicas to stop; they report their counters
            router_thread.join(timeout=10)

        try:
            workers = self._supervise(specs, logger, stop_router)
        except BaseException as exc:
            if isinstance(exc, (StageDied, KeyboardInterrupt)):  # gone before the next attempt; after
                self.scheduler.stop(wait=True)  # Ctrl-C no checkpoint follows the one it names
            self._log(logger)  # the steps reported before (a dead trainer's checkpoint's included)
            raise
        finally:
            stop_router()
            self.scheduler.stop(wait=False)
        workers["router"] = {"dispatched": router.dispatched, "resampled": router.resampled,
                             "redispatched": router.redispatched, "replica_restarts": self.restarts.replicas,
                             "rejected_messages": router.rejected}
        return workers

    def _supervise(self, specs: list[WorkerSpec], logger: RunLogger, stop_router) -> dict:
        topo = self.setup.topo
        by_name = {f"{s.group}/{s.rank}": s for s in specs}
        trainer, ends = f"{topo.trainer.name}/0", run_ends(topo)
        for spec in specs:
            self.scheduler.start(spec, topo.groups[spec.group])
        logger.note(self.scheduler.start_how.format(n=len(specs)))
        done: dict = {}
        while not ends <= set(done):
            ended = self.scheduler.wait(POLL_S)
            self._log(logger)
            for end in ended:
                if end.status == OK:
                    done[end.name] = end.payload
                elif end.status == ERROR:
                    sep = "\n" if "\n" in str(end.payload) else " "  # a brief error is one line
                    raise WorkerFailed(f"{end.name} failed:{sep}{end.payload}")
                else:
                    self._replica_died(end, by_name, by_name[trainer].inbox)
        self._log(logger)
        stop_router()
        replicas = {n for n, s in by_name.items() if topo.groups[s.group].kind == GENERATION}
        while not replicas <= set(done):
            ended = self.scheduler.wait(REPORT_WAIT_S)
            if not ended:
                break
            done.update((e.name, e.payload if e.status == OK else {"error": str(e.payload)}) for e in ended)
        return done

    def _replica_died(self, end: WorkerEnd, by_name: dict[str, WorkerSpec], trainer_inbox: str) -> None:
        """Start dead replica ``end.name`` again at the router's version for it: it asks the
        trainer for that version (resync) and the router sends it its groups again.

        Raises:
            StageDied: a stage worker died, or the replica's host is gone (``run_attempts``
                restarts every worker from the last checkpoint).
            WorkerFailed: the restarts are used up, or the scheduler cannot bring it back.
        """
        spec = by_name[end.name]
        group = self.setup.topo.groups[spec.group]
        admission = self.router.admission
        if group.kind != GENERATION:
            raise StageDied(end.name, end.payload, admission.accepted + admission.running)
        self.restarts.check(f"{end.name} died ({end.payload})")  # before waiting for a host to come back
        try:
            self.scheduler.revive(end.name, end.payload)
        except HostLost as lost:
            raise StageDied(end.name, f"{end.payload}; {lost}", admission.accepted + admission.running) from None
        version = self.router.versions.get(spec.rank, 0)
        self.restarts.replica(end.name, end.payload, version, how=self.scheduler.restart_how)
        self.router.replace_replica(spec.rank, spec.inbox)
        by_name[end.name] = spec = replace(spec, resume_version=version, resync=trainer_inbox)
        self.scheduler.start(spec, group)

    def _log(self, logger: RunLogger) -> None:
        """Log the step reports that arrived.

        Raises:
            StageDied: what carries them died (``ReportsLost``): every worker restarts.
        """
        try:
            reported = self.scheduler.metrics()
        except ReportsLost as lost:
            admission = self.router.admission
            raise StageDied(lost.name, lost.cause, admission.accepted + admission.running) from None
        for metrics in reported:
            logger.log_step(metrics)
