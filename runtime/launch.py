"""Running a plan: ``run(plan)`` on this machine (``local``) or on Ray.

Owns the local scheduler: the workers' processes (``runtime.workers``,
``runtime.stage_worker``), the router's thread (``runtime.router``), the progress and the
restarts. What every scheduler shares around the workers (topology, run folder, models,
held-out accuracy, summary) is ``runtime.run_setup.RunSetup``. The local scheduler starts
every worker as an OS process joined by pyzmq ``ipc://`` channels: ``dp`` generation
replicas and one process per other worker group (a multi-rank trainer spawns its ranks). A generation replica that dies is started again
(``scheduler.max_restarts``; its groups are re-sent under their indices, and it resumes at
the trainer's version). A trainer (or other stage worker) that dies without reporting
(killed, crashed) restarts the run's workers from the last complete checkpoint
(``runtime.checkpoint``; same budget): the groups admitted after it are admitted again
under their indices, the run folder is rewound to it (``runtime.run_dir.rewind_run_dir``).
A worker that raises stops the others and is re-raised with its traceback; what was
already written (events, trajectories) stays. ``resume`` continues a run from its folder's
last checkpoint the same way, on either scheduler; a run whose last checkpoint holds all
its steps is complete, and its resume runs nothing. The restart budget, the attempt loop,
the console lines and the summary's ``restarts`` are shared with Ray (``runtime.restarts``).

Co-located nodes (``|`` in the allocation: generation and a trainer on one mesh) take
turns: a lock per such mesh is held around each engine step and each train step.

Threads: with ``k >= 1`` generation and training overlap, so the cores are split among
the busy processes; with ``k = 0`` (the synchronous baseline) they alternate, so each gets
all of them. Idle OpenMP threads of a waiting worker must not spin on the cores another
needs: workers start with ``OMP_WAIT_POLICY=PASSIVE``. ``scheduler.threads_per_worker`` > 0
sets every worker's threads instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import tempfile
import threading
import traceback

from compiler.plan import Plan
from runtime.lifecycle import die_with_parent, stop_signals_as_interrupt
from runtime.metrics import RunLogger
from runtime.restarts import Restarts, StageDied, WorkerFailed, run_attempts
from runtime.run_setup import RunSetup
from runtime.topology import Topology
from runtime.stage_worker import run_stage_worker
from runtime.workers import WorkerSpec, run_generation_replica


def run(plan: Plan, show_progress: bool = True, resume: str = "", config_yaml: str | None = None) -> dict:
    """Execute ``plan`` (its only input) with the scheduler it names; returns the summary.

    Args:
        resume: ``""`` (a new run), ``"auto"`` or the run's folder (``runtime.checkpoint.resume_point``).
        config_yaml: the resolved config the plan was compiled from, kept in the run folder as
            ``config.yaml`` for the reader (``runtime.run_dir.record_start``); nothing reads it back.

    Raises:
        runtime.topology.TopologyError: the plan asks for what the runtime cannot run.
        runtime.checkpoint.ResumeError: ``resume`` asks for what cannot be resumed (names the
            folder or cause).
        WorkerFailed: a worker raised (its traceback is in the message), or workers died
            more often than ``scheduler.max_restarts``.
        KeyboardInterrupt: Ctrl-C, or ``runtime.lifecycle.Stopped`` for SIGTERM / SIGHUP (the
            workers are stopped first and the last checkpoint is named, either way).
    """
    with stop_signals_as_interrupt():  # SIGTERM / SIGHUP take the Ctrl-C path (runtime.lifecycle)
        setup = RunSetup.create(plan, show_progress, resume, config_yaml)
        if setup.checkpoint is not None and setup.checkpoint.version >= setup.topo.steps:
            return _already_complete(setup)
        if plan.run["scheduler"]["type"] == "ray":
            from runtime.ray_scheduler import run_on_ray

            return run_on_ray(setup)
        setup.prepare()
        return _LocalRun(setup).execute()


def _already_complete(setup: RunSetup) -> dict:
    """A resume of a run whose checkpoint is at its last step: say so and return its
    ``summary.json`` (``{}`` when it has none); nothing is run and no file is written."""
    import json

    summary = setup.out_dir / "summary.json"
    print(f"areal-flow: {setup.out_dir} is complete: {setup.checkpoint.folder.name} holds all {setup.topo.steps} "
          "steps; nothing to resume", file=sys.stderr)
    return json.loads(summary.read_text()) if summary.is_file() else {}


def _time_shared(topo: Topology) -> list:
    """Meshes the plan gives to generation and to another worker group (``|`` in the
    allocation): their workers take turns through one lock (local scheduler)."""
    gen = topo.generation.mesh
    return [gen] if any(g.mesh == gen for g in topo.groups.values() if g.kind != "generation") else []


def _child(target, spec, results, *extra) -> None:
    die_with_parent(mp.parent_process().pid)  # a SIGKILLed driver leaves no worker running
    try:
        results.put((f"{spec.group}/{spec.rank}", "ok", target(spec, *extra)))
    except BaseException as exc:  # report everything, including KeyboardInterrupt, to the parent
        trace = "" if getattr(exc, "brief", False) else f"\n{traceback.format_exc()}"  # a deliberate stop: one line
        results.put((f"{spec.group}/{spec.rank}", "error", f"{type(exc).__name__}: {exc}{trace}"))


def _drain(metrics, logger: RunLogger) -> None:
    """Log every step's metrics waiting in the ``metrics`` queue."""
    while True:
        try:
            logger.log_step(metrics.get_nowait())
        except queue.Empty:
            return


def _stop(procs: dict) -> None:
    """End the worker processes still running (each gets 0.5 s to finish, then SIGTERM)."""
    for p in procs.values():
        if p.is_alive():
            p.join(timeout=0.5)
        if p.is_alive():
            p.terminate()
            p.join()


class _LocalRun:
    def __init__(self, setup: RunSetup) -> None:
        self.setup = setup
        self.restarts = Restarts.for_run(setup)

    def execute(self) -> dict:
        setup = self.setup
        try:
            logger, workers = run_attempts(setup, self.restarts, self._attempt)
        finally:
            setup.merge_trace()
        return setup.finish(logger, workers, restarts=self.restarts.block(workers))

    def _attempt(self, logger: RunLogger) -> dict:
        """Start every worker (from :attr:`RunSetup.checkpoint` when set) and run to the end."""
        setup, topo = self.setup, self.setup.topo
        sock = tempfile.mkdtemp(prefix="areal-flow-")
        addresses = {g.name: [f"ipc://{sock}/{g.name}-{r}" for r in range(g.replicas)] for g in topo.groups.values()}
        addresses["weights"] = [f"ipc://{sock}/weights-{r}" for r in range(topo.generation.replicas)]
        control = f"ipc://{sock}/control"
        n_procs = sum(g.replicas for g in topo.groups.values())
        cores = os.cpu_count() or 2
        threads = int(setup.plan.run["scheduler"].get("threads_per_worker", 0)) or (
            cores if topo.max_staleness == 0 else max(1, cores // n_procs))
        specs = setup.specs(addresses, control, threads)
        router = self.router = setup.router(addresses[topo.generation.name], control)
        stop = threading.Event()
        router_thread = threading.Thread(target=router.run, args=(stop,), daemon=True)
        router_thread.start()
        try:
            workers = self._run(specs, logger, topo, stop, router_thread)
        finally:
            stop.set()
            router_thread.join(timeout=10)
        workers["router"] = {"dispatched": router.dispatched, "resampled": router.resampled,
                             "redispatched": router.redispatched, "replica_restarts": self.restarts.replicas,
                             "rejected_messages": router.rejected}
        return workers

    def _restart(self, name: str, proc, specs: list[WorkerSpec], topo: Topology, ctx, results):
        """Start a dead generation replica again (``scheduler.max_restarts`` in all): it waits
        for the trainer's current version (resync), and the router sends it again every group
        it held, under the same indices.

        Raises:
            StageDied: a non-generation worker died (``runtime.restarts.run_attempts`` restarts
                every worker from the last checkpoint).
            WorkerFailed: too many restarts.
        """
        from dataclasses import replace

        spec = next(s for s in specs if f"{s.group}/{s.rank}" == name)
        if topo.groups[spec.group].kind != "generation":
            admission = self.router.admission
            raise StageDied(name, f"exit code {proc.exitcode}", admission.accepted + admission.running)
        version = self.router.versions.get(spec.rank, 0)
        self.restarts.replica(name, f"exit code {proc.exitcode}", version)
        spec = replace(spec, resume_version=version, resync=self.trainer_inbox)
        self.router.replace_replica(spec.rank, spec.inbox)
        lease = self.leases.get(topo.groups[spec.group].mesh)
        new = ctx.Process(target=_child, args=(run_generation_replica, spec, results, lease), name=name)
        new.start()
        return new

    def _run(self, specs: list[WorkerSpec], logger: RunLogger, topo: Topology, stop: threading.Event,
             router_thread: threading.Thread) -> dict:
        ctx = mp.get_context("spawn")
        results, metrics = ctx.Queue(), ctx.Queue()
        procs = {}
        previous = os.environ.get("OMP_WAIT_POLICY")
        os.environ["OMP_WAIT_POLICY"] = previous or "PASSIVE"
        trainer = None
        self.leases = {mesh: ctx.Lock() for mesh in _time_shared(topo)}
        try:
            for spec in specs:
                group = topo.groups[spec.group]
                lease = self.leases.get(group.mesh)
                if group.kind == "generation":
                    args = (run_generation_replica, spec, results, lease)
                else:
                    args = (run_stage_worker, spec, results, metrics.put if group.batch_nodes else None, lease)
                    if group.batch_nodes:
                        trainer = f"{spec.group}/{spec.rank}"
                name = f"{spec.group}/{spec.rank}"
                procs[name] = ctx.Process(target=_child, args=args, name=name)
                procs[name].start()
        finally:
            if previous is None:
                del os.environ["OMP_WAIT_POLICY"]
        logger.note(f"starting {len(procs)} worker processes (torch, models)")
        done: dict = {}
        self.trainer_inbox = next(s.inbox for s in specs if topo.groups[s.group].batch_nodes)
        try:
            while trainer not in done:
                try:
                    logger.log_step(metrics.get(timeout=0.2))
                    continue
                except queue.Empty:
                    pass
                try:
                    name, status, payload = results.get_nowait()
                except queue.Empty:
                    dead = [n for n, p in procs.items() if not p.is_alive() and p.exitcode not in (0, None)]
                    try:
                        for name in dead:
                            procs[name] = self._restart(name, procs[name], specs, topo, ctx, results)
                    except StageDied:
                        _drain(metrics, logger)  # the steps it reported before dying (the checkpoint's included)
                        raise
                    continue
                if status == "error":
                    sep = "\n" if "\n" in payload else " "  # a brief error is one line
                    raise WorkerFailed(f"{name} failed:{sep}{payload}")
                done[name] = payload
            _drain(metrics, logger)
            stop.set()  # the router tells the replicas to stop; they report their counters
            router_thread.join(timeout=10)
            replicas = {n for n, p in procs.items() if topo.groups[n.rsplit("/", 1)[0]].kind == "generation"}
            while not replicas <= set(done):
                try:
                    name, status, payload = results.get(timeout=10)
                except queue.Empty:
                    break
                done[name] = payload
            return done
        except KeyboardInterrupt:  # stopped first, so every step reported is logged and no checkpoint follows
            _stop(procs)
            _drain(metrics, logger)
            raise
        finally:
            _stop(procs)
