"""Running a plan: ``run(plan)`` on this machine (``local``) or on Ray.

Owns :func:`run` and the local scheduler, :class:`LocalScheduler`: the workers' processes
(``runtime.workers``, ``runtime.stage_worker``), how their ends and metrics reach the driver.
What every scheduler shares is written once: around the workers (topology, run folder,
models, held-out accuracy, summary) ``runtime.run_setup.RunSetup``; the attempt loop, the
router's thread, restarts, which group is the trainer, metrics and the stop
``runtime.driver.Driver``. The local scheduler starts every worker as an OS process joined
by pyzmq ``ipc://`` channels: ``dp`` generation replicas and one process per other worker
group (a multi-rank trainer spawns its ranks). A generation replica that dies is started
again (``scheduler.max_restarts``; its groups are re-sent under their indices, and it resumes at
the trainer's version). A trainer (or other stage worker) that dies without reporting
(killed, crashed) restarts the run's workers from the last complete checkpoint
(``runtime.checkpoint``; same budget): the groups admitted after it are admitted again
under their indices, the run folder is rewound to it (``runtime.run_dir.rewind_run_dir``).
A worker that raises stops the others and is re-raised with its traceback; what was
already written (events, trajectories) stays. ``resume`` continues a run from its folder's
last checkpoint the same way, on either scheduler; a run whose last checkpoint holds all
its steps is complete, and its resume runs nothing. The restart budget, the console lines
and the summary's ``restarts`` are shared with Ray (``runtime.restarts``).

Co-located nodes (``|`` in the allocation: generation and a trainer on one mesh) take
turns: a lock per such mesh is held around each engine step and each train step. With
``scheduler.hybrid`` and a mesh holding one generation replica and a one-process, one-rank
trainer only, the two run in ONE process (``runtime.hybrid``: two threads, a thread lock, the weights handed over in
memory).

Threads: with ``k >= 1`` generation and training overlap, so the cores are split among
the busy processes; with ``k = 0`` (the synchronous baseline) they alternate, so each gets
all of them. Idle OpenMP threads of a waiting worker must not spin on the cores another
needs: workers start with ``OMP_WAIT_POLICY=PASSIVE`` and a short spin before the sleep, the
hybrid worker too, and on a CPU plan with glibc's malloc keeping what it frees
(``runtime.worker_env``). On CPU a waiting worker lends its threads to a computing trainer
(``runtime.core_lending``). ``scheduler.threads_per_worker`` > 0 sets every worker's threads
instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import threading
import traceback
from dataclasses import replace

from compiler.plan import Plan
from runtime.core_lending import CoreLedger
from runtime.driver import DIED, Driver, WorkerEnd, reports
from runtime.hybrid import hybrid_pair, in_memory_weights, run_hybrid, why_not_hybrid
from runtime.lifecycle import die_with_parent, stop_signals_as_interrupt
from runtime.placement import place_process, worker_devices
from runtime.run_setup import RunSetup
from runtime.owned_dir import SOCKETS, new_owned_dir, remove_owned_dir
from runtime.stage_worker import run_stage_worker
from runtime.topology import Topology, WorkerGroup
from runtime.worker_console import clear_bar_before_lines
from runtime.worker_env import CPU_MALLOC, OMP_PASSIVE, started_with
from runtime.workers import WorkerSpec, run_generation_replica


def run(plan: Plan, show_progress: bool = True, resume: str = "", config_yaml: str | None = None) -> dict:
    """Execute ``plan`` (its only input) with the scheduler it names; returns the summary.

    Args:
        resume: ``""`` (a new run), ``"auto"`` or the run's folder (``runtime.checkpoint.resume_point``).
        config_yaml: the resolved config the plan was compiled from, kept in the run folder as
            ``config.yaml`` (None: a ``run --plan``, whose ``plan.json`` is the whole program).

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
        on_ray = plan.run["scheduler"]["type"] == "ray"
        if plan.run["scheduler"].get("hybrid", False):  # asked for one process: say when it cannot be
            why = "the Ray scheduler runs an actor for each" if on_ray else why_not_hybrid(setup.topo)
            if why:
                print(f"areal-flow: scheduler.hybrid: generation and trainer run as two processes: {why}",
                      file=sys.stderr)
        if on_ray:
            from runtime.ray_scheduler import run_on_ray

            return run_on_ray(setup)
        setup.prepare()
        return Driver(setup, LocalScheduler(setup)).execute()


def _already_complete(setup: RunSetup) -> dict:
    """A resume of a run whose checkpoint is at its last step: say so and return its
    ``summary.json`` (``{}`` when it has none); nothing is run and no file is written."""
    import json

    summary = setup.out_dir / "summary.json"
    print(f"areal-flow: {setup.out_dir} is complete: {setup.checkpoint.folder.name} holds all {setup.topo.steps} "
          "steps; nothing to resume", file=sys.stderr)
    return json.loads(summary.read_text()) if summary.is_file() else {}


_HYBRID_START = "hybrid: generation and training time-share one process; starting the workers (torch, models)"
"""The start line of an attempt with the hybrid worker (``runtime.hybrid``)."""


def _time_shared(topo: Topology) -> list:
    """Meshes the plan gives to generation and to another worker group (``|`` in the
    allocation): their workers take turns through one lock (local scheduler)."""
    gen = topo.generation.mesh
    return [gen] if any(g.mesh == gen for g in topo.groups.values() if g.kind != "generation") else []


def _child(placement, target, spec, results, *extra) -> None:
    """A local worker process: tied to its driver, placed on its devices
    (``runtime.placement``), then ``target(spec, *extra)``, filed by :func:`_filed`."""
    die_with_parent(mp.parent_process().pid)  # a SIGKILLed driver leaves no worker running
    clear_bar_before_lines()  # its lines on the driver's terminal take the progress bar's line whole
    placed: dict = {}
    _filed(results, spec, lambda: placed.update(place_process(*placement)) or target(spec, *extra), placed)


def _hybrid_child(placement, gen_spec, train_spec, results, report) -> None:
    """The hybrid worker's process (``runtime.hybrid``): a generation replica and the trainer,
    each filed by :func:`_filed` under its own name (a placement error under the trainer's)."""
    die_with_parent(mp.parent_process().pid)
    clear_bar_before_lines()
    placed: dict = {}
    if _filed(results, train_spec, lambda: placed.update(place_process(*placement)), placed):
        run_hybrid(gen_spec, train_spec, report, threading.Lock(),
                   lambda spec, work: _filed(results, spec, work, placed))


def _filed(results, spec, work, placed: dict) -> bool:
    """Run ``work()``; put ``(worker, "ok", report)`` on ``results`` (a dict report gets
    ``placement``, what the process was given, its ``core_lending`` counts when it took part
    (``runtime.core_lending``) and its ``pid``; a None report puts nothing),
    or ``(worker, "error", message)`` with the traceback. True when ``work`` returned."""
    name = f"{spec.group}/{spec.rank}"
    try:
        report = work()
        if report is not None:
            lending = spec.cores.report() if spec.cores is not None else {}  # runtime.core_lending
            results.put((name, "ok", {**report, "placement": placed, **lending, "pid": os.getpid()}
                         if isinstance(report, dict) else report))
        return True
    except BaseException as exc:  # report everything, including KeyboardInterrupt, to the parent
        trace = "" if getattr(exc, "brief", False) else f"\n{traceback.format_exc()}"  # a deliberate stop: one line
        results.put((name, "error", f"{type(exc).__name__}: {exc}{trace}"))
        return False


def _worker_env(device_type: str) -> dict[str, str]:
    """The environment defaults a local worker starts with (``runtime.worker_env``): OpenMP
    threads that sleep after a short spin; on CPU, glibc's malloc keeping what it frees."""
    return {**OMP_PASSIVE, **(CPU_MALLOC if device_type == "cpu" else {})}


class LocalScheduler:
    """The ``local`` :class:`runtime.driver.Scheduler`: one OS process per worker (spawned),
    pyzmq ``ipc://`` channels in a fresh folder per attempt, reports and step metrics through
    process queues, one lock per time-shared mesh, a dead process noticed by its exit code."""

    restart_how = "restarting it"

    def __init__(self, setup: RunSetup) -> None:
        self.setup = setup
        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, mp.Process] = {}
        self.results = self.reports = None
        self.leases: dict = {}
        self.sock: str | None = None  # this attempt's ipc:// socket folder (runtime.owned_dir)
        self.hybrid = hybrid_pair(setup.topo) if setup.plan.run["scheduler"].get("hybrid", False) else None
        self.ledger: CoreLedger | None = None  # made per attempt by addresses()
        self.start_how = _HYBRID_START if self.hybrid else "starting {n} workers (torch, models)"
        self.waiting: dict[str, WorkerSpec] = {}  # the hybrid worker's specs until both are given

    def addresses(self) -> tuple[dict[str, list[str]], str, int]:
        topo = self.setup.topo
        remove_owned_dir(self.sock)  # an attempt stopped by a restart: its folder is done
        sock = self.sock = new_owned_dir(SOCKETS)
        addresses = {g.name: [f"ipc://{sock}/{g.name}-{r}" for r in range(g.replicas)] for g in topo.groups.values()}
        addresses["weights"] = [f"ipc://{sock}/weights-{r}" for r in range(topo.generation.replicas)]
        if self.hybrid:
            in_memory_weights(addresses, sock)
        n_procs = sum(g.replicas for g in topo.groups.values()) - bool(self.hybrid)
        cores = os.cpu_count() or 2
        scheduler = self.setup.plan.run["scheduler"]
        threads = int(scheduler.get("threads_per_worker", 0)) or (
            cores if topo.max_staleness == 0 else max(1, cores // n_procs))
        lend = (topo.max_staleness >= 1 and n_procs > 1 and not self.hybrid and scheduler.get("lend_idle_cores", True)
                and not scheduler.get("threads_per_worker", 0) and not scheduler.get("cpu_pinning", False)
                and self.setup.plan.device_type == "cpu")
        self.ledger = CoreLedger(n_procs, cores, self.ctx) if lend else None  # runtime.core_lending
        self.procs, self.results, self.reports = {}, self.ctx.Queue(), self.ctx.Queue()
        self.leases = {} if self.hybrid else {mesh: self.ctx.Lock() for mesh in _time_shared(topo)}
        self.waiting = {}
        return addresses, f"ipc://{sock}/control", threads

    def start(self, spec: WorkerSpec, group: WorkerGroup) -> None:
        if self.hybrid and group.name in (self.hybrid[0].name, self.hybrid[1].name):
            return self._start_hybrid(spec, group)
        name, lease = f"{spec.group}/{spec.rank}", self.leases.get(group.mesh)
        devices = worker_devices(group.mesh, group.replicas, spec.rank)  # its mesh's devices (runtime.placement)
        pinning = bool(self.setup.plan.run["scheduler"].get("cpu_pinning", False))
        if pinning and spec.plan.device_type == "cpu":  # one core per device: threads to match
            spec = replace(spec, threads=len(devices))
        if self.ledger is not None and (group.kind == "generation" or group.strategy.world_size == 1):
            spec = replace(spec, cores=self.ledger.share(name, spec.threads))  # not a multi-rank trainer
        placement = (devices, spec.plan.device_type, pinning)
        if group.kind == "generation":
            args = (run_generation_replica, spec, self.results, lease)
        else:
            args = (run_stage_worker, spec, self.results, self.reports.put if reports(self.setup.topo, group) else None,
                    lease)
        self.procs[name] = self.ctx.Process(target=_child, args=(placement, *args), name=name)
        with started_with(_worker_env(spec.plan.device_type)):
            self.procs[name].start()

    def _start_hybrid(self, spec: WorkerSpec, group: WorkerGroup) -> None:
        """Hold the spec until both of the hybrid worker's are given, then start its one
        process (``runtime.hybrid``) under both names."""
        gen, trainer = self.hybrid
        self.waiting[group.name] = spec
        if set(self.waiting) != {gen.name, trainer.name}:
            return
        gen_spec, train_spec = self.waiting.pop(gen.name), self.waiting.pop(trainer.name)
        devices = worker_devices(trainer.mesh, 1, 0)
        pinning = bool(self.setup.plan.run["scheduler"].get("cpu_pinning", False))
        if pinning and spec.plan.device_type == "cpu":
            gen_spec, train_spec = (replace(s, threads=len(devices)) for s in (gen_spec, train_spec))
        report = self.reports.put if reports(self.setup.topo, trainer) else None
        proc = self.ctx.Process(target=_hybrid_child, name=f"{train_spec.group}/0+{gen_spec.group}/0",
                                args=((devices, spec.plan.device_type, pinning), gen_spec, train_spec, self.results,
                                      report))
        self.procs[f"{gen_spec.group}/0"] = self.procs[f"{train_spec.group}/0"] = proc
        with started_with(_worker_env(train_spec.plan.device_type)):  # its waiting thread's OpenMP team sleeps too
            proc.start()

    def wait(self, timeout_s: float) -> list[WorkerEnd]:
        try:
            return [WorkerEnd(*self.results.get(timeout=timeout_s))]
        except queue.Empty:  # a dead hybrid process is its trainer's death (runtime.hybrid)
            hybrid_replica = f"{self.hybrid[0].name}/0" if self.hybrid else None
            return [WorkerEnd(n, DIED, f"exit code {p.exitcode}") for n, p in self.procs.items()
                    if not p.is_alive() and p.exitcode not in (0, None) and n != hybrid_replica]

    def metrics(self) -> list[dict]:
        out = []
        while True:
            try:
                out.append(self.reports.get_nowait())
            except queue.Empty:
                return out

    def revive(self, name: str, cause: str) -> None:
        """Nothing: a new process is started in its place."""

    def stop(self, wait: bool) -> None:
        """End the worker processes still running (each gets 0.5 s to finish, then SIGTERM);
        every process is joined either way, then the attempt's socket folder is removed."""
        for p in {id(p): p for p in self.procs.values()}.values():  # a hybrid process once
            if p.is_alive():
                p.join(timeout=0.5)
            if p.is_alive():
                p.terminate()
                p.join()
        remove_owned_dir(self.sock)
        self.sock = None

    def release(self) -> dict:
        return {}
