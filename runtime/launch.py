"""Running a plan: ``run(plan)`` on this machine (``local``) or on Ray; what both share.

Owns the run's lifecycle around the workers (``runtime.workers``): the plan's topology
(``runtime.topology``, refused before any process starts when it cannot run), the
version-0 models (``runtime.model_source.prepare_models``), held-out accuracy before and
after RL, the router (``runtime.router``, a thread of this process), progress, and the
summary. The local scheduler starts every worker as an OS process joined by pyzmq
``ipc://`` channels: ``dp`` generation replicas and one process per other worker group (a
multi-rank trainer spawns its ranks). A generation replica that dies is started again
(``scheduler.max_restarts``; its groups are re-sent under their indices, and it resumes at
the trainer's version); any other worker's failure stops the others and is re-raised with
its traceback; what was already written (events, trajectories) stays.

Co-located nodes (``|`` in the allocation: generation and a trainer on one mesh) take
turns: a lock per such mesh is held around each engine step and each train step.

Threads: with ``k >= 1`` generation and training overlap, so the cores are split among
the busy processes; with ``k = 0`` (the synchronous baseline) they alternate, so each gets
all of them. Idle OpenMP threads of a waiting worker must not spin on the cores another
needs: workers start with ``OMP_WAIT_POLICY=PASSIVE``.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import threading
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from areal_flow.ops.dataset import build_task
from compiler.plan import Plan
from runtime.channel_auth import new_secret
from runtime.metrics import RunLogger, format_summary
from runtime.router import Router
from runtime.run_dir import fresh_run_dir
from runtime.topology import Topology, build_topology
from runtime.trace import TraceRecorder, merge_trace
from runtime.stage_worker import run_stage_worker
from runtime.workers import WorkerSpec, run_generation_replica


class WorkerFailed(RuntimeError):
    """A worker process raised; the message holds its traceback."""


def run_experiment(graph, cfg, show_progress: bool = True) -> dict:
    """Compile ``graph`` under ``cfg`` into a plan and run it (``areal-flow run graph.py``)."""
    from areal_flow.program import compile_program

    return run(compile_program(graph, cfg), show_progress)


def run(plan: Plan, show_progress: bool = True) -> dict:
    """Execute ``plan`` (its only input) with the scheduler it names; returns the summary.

    Raises:
        runtime.topology.TopologyError: the plan asks for what the runtime cannot run.
        WorkerFailed: a worker raised (its traceback is in the message).
    """
    if plan.run["scheduler"]["type"] == "ray":
        from runtime.ray_scheduler import run_on_ray

        return run_on_ray(plan, show_progress)
    setup = RunSetup.create(plan, show_progress)
    setup.prepare()
    return _LocalRun(setup).execute()


@dataclass
class RunSetup:
    """The parts of a run every scheduler shares, around its workers."""

    plan: Plan
    topo: Topology
    out_dir: Path
    show_progress: bool = True
    task: object = None
    folders: dict = field(default_factory=dict)
    test_set: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    secret: bytes = field(default_factory=new_secret, repr=False)
    """The run's channel secret (``runtime.channel_auth``): drawn here, given to every worker."""

    @classmethod
    def create(cls, plan: Plan, show_progress: bool = True) -> "RunSetup":
        """Check the topology, start an empty run folder (an earlier run's is moved aside,
        ``runtime.run_dir``) and write ``plan.json`` (no model is touched: cheap)."""
        from compiler import format_table

        topo = build_topology(plan)
        out_dir = Path(plan.run["out_dir"]).resolve() / plan.run["name"]
        moved = fresh_run_dir(out_dir)
        if moved is not None:
            print(f"areal-flow: {out_dir} held an earlier run; moved it to {moved.name}", file=sys.stderr)
        (out_dir / "plan.json").write_text(plan.to_json())
        from compiler.device_check import device_mismatch_warning

        if show_progress:
            print(format_table(plan))
            for note in topo.notes:
                print(f"note: {note}")
        warning = device_mismatch_warning(plan.cluster["gpu"])
        if warning:
            print(f"areal-flow: warning: {warning}", file=sys.stderr)
        return cls(plan, topo, out_dir, show_progress)

    def logger(self) -> RunLogger:
        """TensorBoard (and W&B when ``logging.wandb``) + progress bar for this run."""
        from types import SimpleNamespace

        wandb = SimpleNamespace(**self.plan.run["logging"]) if self.plan.run.get("logging") else None
        return RunLogger(self.out_dir, self.topo.steps, self.show_progress, wandb=wandb,
                         run_name=self.plan.run["name"], config={"plan_id": self.plan.id, **self.plan.run})

    @property
    def eval_enabled(self) -> bool:
        return bool(self.plan.run["eval"].get("enabled", True))

    def prepare(self) -> None:
        """Version-0 models, and held-out greedy accuracy before RL."""
        from runtime.model_source import prepare_models

        self.task = build_task(self.topo.dataset.attrs, self.plan.run["seed"])
        self.folders = prepare_models(self.plan, self.task, progress=self.show_progress)
        policy = self.topo.generate.model
        from runtime.parallel_trainer import check_parallel_training

        for node in self.topo.train_steps:  # before any worker starts, naming the broken rule
            if node.parallel.world_size > 1:
                rows = self.topo.batch_groups * self.topo.generate.attrs["n_samples"]
                check_parallel_training(node.parallel, self.folders[node.model], rows=rows,
                                        critic=self.plan.models[node.model]["head"] != "lm",
                                        max_tokens_per_micro_batch=node.attrs.get("max_tokens_per_micro_batch", 0))
        self.extra = {"out_dir": str(self.out_dir), "initial_model": self.folders[policy], "plan_id": self.plan.id}
        if self.eval_enabled:
            self.test_set = self.task.test_set(self.plan.run["eval"]["n_test"])
            self._held_out(self.folders[policy], "before")
            if self.show_progress:
                print(f"held-out {self.extra['eval_kind']} before RL: {self.extra['accuracy_before']:.1%} "
                      f"({len(self.test_set)} problems)")

    def _held_out(self, folder, when: str) -> None:
        """``accuracy_<when>`` on the held-out set (and the answer kinds, or for episodes of a
        rollout node ``episodes_<when>``: return, turns, env info means)."""
        gen = self.topo.generate
        temperature = float(self.plan.run["eval"].get("temperature", 0.0))
        sampled = f"sampled at temperature {temperature:g}" if temperature else "greedy"
        self.extra["eval_kind"] = f"episode success rate ({sampled})" if gen.op == "rollout" else "greedy accuracy"
        if gen.op == "rollout":
            from compiler.plan import decode_value
            from runtime.engines.evaluate import evaluate_episodes
            from runtime.executors.rollout import episode_context
            from runtime.model_source import load_pretrained

            attrs = decode_value(gen.attrs)
            model, tokenizer = load_pretrained(folder)
            stats = evaluate_episodes(model, tokenizer, attrs, self.test_set,
                                      temperature=temperature,
                                      max_context=episode_context(attrs, folder))
            self.extra[f"accuracy_{when}"] = stats.pop("accuracy")
            self.extra[f"episodes_{when}"] = stats
            return
        self.extra[f"accuracy_{when}"], kinds = _evaluate(folder, self.task, self.test_set,
                                                          gen.attrs.get("chat_template"))
        if kinds:
            self.extra[f"answer_kinds_{when}"] = kinds

    def router(self, replicas: list[str], control: str) -> Router:
        """The router over the dataset's prompts (a separate seeded stream for resampled slots)."""
        n = self.topo.steps * self.topo.batch_groups
        seed = self.plan.run["seed"]
        problems = self.task.train_problems(n, seed=seed + 1)
        filters = [n_.attrs.get("max_attempts", 1) for n_ in self.plan.nodes if n_.op == "filter"]
        chunk = n * max(max(filters, default=2) - 1, 1)
        trace = TraceRecorder.for_plan(self.plan, self.out_dir, "driver")
        return Router(problems, _spares(self.task, chunk, seed), self.topo.max_staleness, self.topo.batch_groups,
                      replicas, control, trace, admission_edge=f"{self.topo.dataset.name}->{self.topo.generate.name}",
                      secret=self.secret)

    def merge_trace(self) -> None:
        """Merge the workers' spans into ``trace.json`` (``runtime.trace``), on success or failure;
        its path goes into the summary."""
        path = merge_trace(self.out_dir) if self.plan.run.get("logging", {}).get("trace", True) else None
        if path is not None:
            self.extra["trace"] = str(path)

    def specs(self, addresses: dict[str, list[str]], control: str, threads: int) -> list[WorkerSpec]:
        """One spec per worker process: ``addresses[group]`` are its workers' inboxes, and for
        the generation group also ``addresses["weights"]`` its replicas' weight channels."""
        specs = []
        common = dict(plan=self.plan, folders=self.folders, out_dir=str(self.out_dir), control=control,
                      threads=threads, secret=self.secret)
        for g in self.topo.groups.values():
            downstream = {d: addresses[d][0] for d in g.downstream}
            for r in range(g.replicas):
                specs.append(WorkerSpec(group=g.name, rank=r, inbox=addresses[g.name][r], downstream=downstream,
                                        weights=addresses["weights"][r] if g.kind == "generation" else "",
                                        routes={ts: addresses["weights"] for ts, _ in self.topo.routes
                                                if ts in g.nodes}, **common))
        return specs

    def finish(self, logger: RunLogger, workers: dict, **extra) -> dict:
        """Close ``logger``, measure held-out accuracy after RL, write and return the summary."""
        logger.close()
        self.extra.update(model_dir=str(self.out_dir / "model"), trajectories=str(self.out_dir / "trajectories"),
                          workers=workers, **extra)
        if self.eval_enabled:
            self._held_out(self.out_dir / "model", "after")
        summary = logger.summary(**self.extra)
        if self.show_progress:
            print(format_summary(summary))
        return summary


def _spares(task, chunk: int, seed: int) -> Iterator[dict]:
    """Endless prompts for resampled slots (a filter's drop, a group whose every sample failed):
    ``chunk`` problems from seed ``seed + 2``, then further chunks from further seeds."""
    for round_ in itertools.count():
        yield from task.train_problems(chunk, seed=seed + 2 + 10_000 * round_)


def _evaluate(folder, task, problems: list[dict], chat_template) -> tuple[float, dict | None]:
    """Held-out greedy accuracy of the policy in ``folder``, and the count of each
    ``task.answer_kind`` (None when the task does not classify its answers)."""
    from runtime.engines.evaluate import answer_accuracy, greedy_answers
    from runtime.model_source import load_pretrained

    model, tokenizer = load_pretrained(folder)
    answers = greedy_answers(model, tokenizer, task, problems, chat_template=chat_template)
    accuracy = answer_accuracy(task, answers, problems)
    if not hasattr(task, "answer_kind"):
        return accuracy, None
    kinds = Counter(task.answer_kind(p, text) for text, p in zip(answers, problems))
    return accuracy, {kind: kinds[kind] for kind in task.ANSWER_KINDS}


def _time_shared(topo: Topology) -> list:
    """Meshes the plan gives to generation and to another worker group (``|`` in the
    allocation): their workers take turns through one lock (local scheduler)."""
    gen = topo.generation.mesh
    return [gen] if any(g.mesh == gen for g in topo.groups.values() if g.kind != "generation") else []


def _child(target, spec, results, *extra) -> None:
    try:
        results.put((f"{spec.group}/{spec.rank}", "ok", target(spec, *extra)))
    except BaseException as exc:  # report everything, including KeyboardInterrupt, to the parent
        trace = "" if getattr(exc, "brief", False) else f"\n{traceback.format_exc()}"  # a deliberate stop: one line
        results.put((f"{spec.group}/{spec.rank}", "error", f"{type(exc).__name__}: {exc}{trace}"))


class _LocalRun:
    def __init__(self, setup: RunSetup) -> None:
        self.setup = setup
        self.restarts = 0

    def execute(self) -> dict:
        setup, topo = self.setup, self.setup.topo
        sock = tempfile.mkdtemp(prefix="areal-flow-")
        addresses = {g.name: [f"ipc://{sock}/{g.name}-{r}" for r in range(g.replicas)] for g in topo.groups.values()}
        addresses["weights"] = [f"ipc://{sock}/weights-{r}" for r in range(topo.generation.replicas)]
        control = f"ipc://{sock}/control"
        n_procs = sum(g.replicas for g in topo.groups.values())
        cores = os.cpu_count() or 2
        threads = cores if topo.max_staleness == 0 else max(1, cores // n_procs)
        specs = setup.specs(addresses, control, threads)
        router = self.router = setup.router(addresses[topo.generation.name], control)
        logger = setup.logger()
        stop = threading.Event()
        router_thread = threading.Thread(target=router.run, args=(stop,), daemon=True)
        router_thread.start()
        try:
            workers = self._run(specs, logger, topo, stop, router_thread)
        finally:
            stop.set()
            router_thread.join(timeout=10)
            setup.merge_trace()
        workers["router"] = {"dispatched": router.dispatched, "resampled": router.resampled,
                             "redispatched": router.redispatched, "replica_restarts": self.restarts,
                             "rejected_messages": router.rejected}
        return setup.finish(logger, workers)

    def _restart(self, name: str, proc, specs: list[WorkerSpec], topo: Topology, ctx, results):
        """Start a dead generation replica again (``scheduler.max_restarts`` in all): it waits
        for the trainer's current version (resync), and the router sends it again every group
        it held, under the same indices. Any other worker's death fails the run.

        Raises:
            WorkerFailed: a non-generation worker died, or too many restarts.
        """
        from dataclasses import replace

        spec = next(s for s in specs if f"{s.group}/{s.rank}" == name)
        limit = int(self.setup.plan.run["scheduler"].get("max_restarts", 0))
        if topo.groups[spec.group].kind != "generation" or self.restarts >= limit:
            raise WorkerFailed(f"worker {name} died (exit code {proc.exitcode}); restarts so far {self.restarts}, "
                               f"scheduler.max_restarts={limit}")
        self.restarts += 1
        version = self.router.versions.get(spec.rank, 0)
        print(f"areal-flow: {name} died (exit code {proc.exitcode}); restarting it at policy version {version} "
              f"({self.restarts}/{limit})", file=sys.stderr)
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
                    for name in dead:
                        procs[name] = self._restart(name, procs[name], specs, topo, ctx, results)
                    continue
                if status == "error":
                    sep = "\n" if "\n" in payload else " "  # a brief error is one line
                    raise WorkerFailed(f"{name} failed:{sep}{payload}")
                done[name] = payload
            while True:
                try:
                    logger.log_step(metrics.get_nowait())
                except queue.Empty:
                    break
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
        finally:
            for p in procs.values():
                if p.is_alive():
                    p.join(timeout=0.5)
                if p.is_alive():
                    p.terminate()
                    p.join()
