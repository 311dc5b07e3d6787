"""The local scheduler: run a compiled graph as a generation process and a training process.

Owns process lifecycle on one machine: it compiles the plan (the same compiler as for a
cluster, with the ``cpu`` preset), prepares the version-0 policy, measures held-out
accuracy before and after, starts the rollout and trainer workers as separate OS
processes joined by the experience and weight channels (pyzmq over ``ipc://``), shows
progress, and writes the run summary. When the plan's ``train_step`` strategy has world size
> 1 (e.g. ``compile.allocation="train:d2 + gen:d1"``), the trainer process runs that many
ranks (``runtime.parallel_trainer``); the strategy is checked before any process starts. A worker's failure stops the other and is re-raised
with its traceback; what was already written (events, trajectories) stays. The steps
around the workers are :class:`RunSetup`, shared with the Ray scheduler
(``runtime.ray_scheduler``, ``scheduler.type=ray``).

Thread split: with ``max_staleness >= 1`` generation and training overlap, so each
process gets half the cores; with ``max_staleness = 0`` (the synchronous baseline) they
alternate, so each gets all of them. The comparison in ``bench/async_vs_sync.py`` is
therefore fair to the synchronous mode.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from areal_flow.config import ExperimentConfig
from areal_flow.graph import Graph, GraphError
from areal_flow.ops.dataset import build_task
from compiler.strategy import ParallelStrategy
from runtime.metrics import RunLogger, format_summary
from runtime.model_source import load_pretrained, prepare_initial_model
from runtime.rollout_worker import RolloutSpec, run_rollout_worker
from runtime.trainer_worker import TrainerSpec, run_trainer_worker


@dataclass
class LocalRoles:
    """The nodes the local runtime runs: one of each kind, plus the critic's ``train_step``
    when the advantage node reads a trainable critic (PPO)."""

    dataset: object
    generate: object
    reward: object
    advantage: object
    train_step: object
    critic_step: object = None


def local_roles(graph: Graph) -> LocalRoles:
    """Pick the single node of each kind the local runtime runs. The policy's
    ``train_step`` is the one of the generator's model; a second one must train the
    advantage node's critic with the same algorithm and staleness bound (one
    ``BaseAlgorithm.update_parameters`` call steps both, in the trainer process).

    Raises:
        GraphError: a kind is missing or repeated, or a ``train_step`` other than the
            policy's and its critic's (naming it).
    """
    picked = {}
    for op in ("dataset", "generate", "reward", "advantage"):
        nodes = graph.nodes_of(op)
        if len(nodes) != 1:
            raise GraphError(
                f"graph '{graph.name}': the local runtime runs exactly one '{op}' node, found {len(nodes)} "
                f"({', '.join(n.name for n in nodes) or 'none'})"
            )
        picked[op] = nodes[0]
    steps = {n.model: n for n in graph.nodes_of("train_step")}
    policy, critic = picked["generate"].model, picked["advantage"].model
    if policy not in steps:
        raise GraphError(f"graph '{graph.name}': no train_step updates the generator's model '{policy}'")
    picked["train_step"] = steps.pop(policy)
    if picked["advantage"].attrs.get("model_role") == "critic":
        if critic not in steps:
            raise GraphError(f"{picked['advantage'].where()}: critic '{critic}' has no train_step; the local "
                             f"runtime trains the critic with the policy: declare ops.train_step({critic}, ...)")
        picked["critic_step"] = step = steps.pop(critic)
        for key in ("algorithm", "max_staleness"):
            if step.attrs[key] != picked["train_step"].attrs[key]:
                raise GraphError(f"{step.where()}: {key}={step.attrs[key]!r} must equal the policy train_step's "
                                 f"({picked['train_step'].attrs[key]!r}): one optimizer step trains both")
    if steps:
        raise GraphError(f"{next(iter(steps.values())).where()}: the local runtime trains only the policy and "
                         "the advantage node's critic")
    synced = any(e.kind == "weights" and e.dst == picked["generate"].name for e in graph.edges)
    if not synced:  # the generator would sample with version 0 forever and admission would stall
        raise GraphError(f"{picked['train_step'].where()}: no ops.sync_weights({policy}, to=...) routes the new "
                         f"weights to {picked['generate'].where()}; add it after the train_step")
    return LocalRoles(**picked)


def _child(target, spec, result_queue, *extra) -> None:
    try:
        result_queue.put((target.__name__, "ok", target(spec, *extra)))
    except BaseException as exc:  # report everything, including KeyboardInterrupt, to the parent
        result_queue.put((target.__name__, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class WorkerFailed(RuntimeError):
    """A worker process raised; the message holds its traceback."""


@dataclass
class RunSetup:
    """The parts of a run every scheduler shares, around its workers: the roles, the plan
    (written to ``plan.json``), the version-0 policy, held-out accuracy before and after RL,
    the worker specs and the summary. Made by :meth:`plan_run`; fields after ``plan`` are
    filled by :meth:`prepare_policy`."""

    cfg: ExperimentConfig
    roles: LocalRoles
    out_dir: Path
    plan: object
    show_progress: bool = True
    task: object = None
    folder: Path | None = None
    test_set: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def max_staleness(self) -> int:
        """k of the policy's ``train_step`` (versions)."""
        return self.roles.train_step.attrs["max_staleness"]

    @property
    def train_strategy(self) -> ParallelStrategy:
        """The plan's strategy of the policy's ``train_step``: world size > 1 runs the trainer
        as that many processes (``runtime.parallel_trainer``)."""
        return self.plan.node(self.roles.train_step.name).parallel

    @classmethod
    def plan_run(cls, graph: Graph, cfg: ExperimentConfig, show_progress: bool = True) -> "RunSetup":
        """Pick the roles and compile the plan (no model is touched: cheap).

        Raises:
            GraphError: the graph has a shape the runtime does not run.
        """
        from compiler import compile_plan, format_table

        roles = local_roles(graph)
        out_dir = Path(cfg.out_dir) / cfg.name
        out_dir.mkdir(parents=True, exist_ok=True)
        plan = compile_plan(graph, cfg.cluster, cfg.compile)
        (out_dir / "plan.json").write_text(plan.to_json())
        if show_progress:
            print(format_table(plan))
        return cls(cfg, roles, out_dir, plan, show_progress)

    def prepare_policy(self) -> None:
        """Build the version-0 policy folder and measure held-out greedy accuracy before RL."""
        cfg, gen = self.cfg, self.roles.generate.attrs
        self.task = build_task(self.roles.dataset.attrs, cfg.seed)
        self.folder = prepare_initial_model(cfg, self.task, progress=self.show_progress)
        if self.train_strategy.world_size > 1:  # before any process starts, naming the broken rule
            from runtime.parallel_trainer import check_parallel_training

            check_parallel_training(self.train_strategy, self.folder, rows=cfg.train.batch_size * gen["n_samples"],
                                    critic=self.roles.critic_step is not None)
        self.test_set = self.task.test_set(cfg.eval.n_test) if cfg.eval.enabled else []
        self.extra = {"out_dir": str(self.out_dir), "initial_model": str(self.folder)}
        if cfg.eval.enabled:
            self.extra["accuracy_before"], kinds = _evaluate(self.folder, self.task, self.test_set,
                                                             gen.get("chat_template"))
            if kinds:
                self.extra["answer_kinds_before"] = kinds
            if self.show_progress:
                print(f"held-out greedy accuracy before RL: {self.extra['accuracy_before']:.1%} "
                      f"({len(self.test_set)} problems)")

    def worker_specs(self, experience: str, weights: str, threads: int) -> tuple[RolloutSpec, TrainerSpec]:
        """The two workers' specs joined by the ``experience`` and ``weights`` channel addresses."""
        cfg, roles, k = self.cfg, self.roles, self.max_staleness
        gen = roles.generate.attrs
        rollout_spec = RolloutSpec(
            model_folder=str(self.folder), dataset_attrs=roles.dataset.attrs, generate_attrs=gen,
            reward_fn=roles.reward.attrs["fn"], reward_attrs=roles.reward.attrs,
            n_groups=cfg.train.steps * cfg.train.batch_size, batch_groups=cfg.train.batch_size, max_staleness=k,
            max_batch_size=cfg.gen.max_batch_size, seed=cfg.seed, experience_address=experience,
            weight_address=weights, threads=threads,
        )
        adv_attrs = {key: v for key, v in roles.advantage.attrs.items() if key not in ("estimator", "model_role")}
        reads = roles.advantage.attrs.get("model_role")
        trainer_spec = TrainerSpec(
            model_folder=str(self.folder), algorithm=roles.train_step.attrs["algorithm"],
            estimator=roles.advantage.attrs["estimator"], estimator_kwargs=adv_attrs,
            loss_overrides=dict(cfg.train.loss),
            steps=cfg.train.steps, batch_groups=cfg.train.batch_size, max_staleness=k, lr=cfg.train.lr,
            weight_decay=cfg.train.weight_decay, max_grad_norm=cfg.train.max_grad_norm,
            micro_batch_size=cfg.train.micro_batch_size, temperature=gen["temperature"] or 1.0, seed=cfg.seed,
            experience_address=experience, weight_address=weights, out_dir=str(self.out_dir), threads=threads,
            critic=roles.critic_step is not None, ref=reads == "ref", checkpoint_every=cfg.train.checkpoint_every,
        )
        return rollout_spec, trainer_spec

    def finish(self, logger: RunLogger, workers: dict, **extra) -> dict:
        """Close ``logger``, measure held-out accuracy after RL, write and return the summary
        (``summary.json``); ``extra`` adds scheduler-specific entries."""
        logger.close()
        out_dir = self.out_dir
        self.extra.update(model_dir=str(out_dir / "model"), trajectories=str(out_dir / "trajectories"),
                          workers=workers, **extra)
        if self.cfg.eval.enabled:
            self.extra["accuracy_after"], kinds = _evaluate(out_dir / "model", self.task, self.test_set,
                                                            self.roles.generate.attrs.get("chat_template"))
            if kinds:
                self.extra["answer_kinds_after"] = kinds
        summary = logger.summary(**self.extra)
        if self.show_progress:
            print(format_summary(summary))
        return summary


def run_experiment(graph: Graph, cfg: ExperimentConfig, show_progress: bool = True) -> dict:
    """Run ``graph`` with ``cfg`` on this machine; returns the run summary.

    Raises:
        GraphError: the graph has a shape the local runtime does not run.
        WorkerFailed: a worker raised (its traceback is in the message).
    """
    if cfg.scheduler.type == "ray":
        from runtime.ray_scheduler import run_experiment_on_ray

        return run_experiment_on_ray(graph, cfg, show_progress)
    cores = os.cpu_count() or 2
    torch.set_num_threads(cores)
    run = RunSetup.plan_run(graph, cfg, show_progress)
    threads = cores if run.max_staleness == 0 else max(1, cores // 2)
    run.prepare_policy()
    sock_dir = tempfile.mkdtemp(prefix="areal-flow-")
    rollout_spec, trainer_spec = run.worker_specs(f"ipc://{sock_dir}/experience", f"ipc://{sock_dir}/weights", threads)
    logger = RunLogger(run.out_dir, cfg.train.steps, show_progress)
    return run.finish(logger, _run_workers(rollout_spec, trainer_spec, logger, run.train_strategy))


def _evaluate(folder: Path, task, problems: list[dict], chat_template: bool | None) -> tuple[float, dict | None]:
    """Held-out greedy accuracy of the policy in ``folder``, and the count of each
    ``task.answer_kind`` (None when the task does not classify its answers)."""
    from runtime.engines.evaluate import answer_accuracy, greedy_answers

    model, tokenizer = load_pretrained(folder)
    answers = greedy_answers(model, tokenizer, task, problems, chat_template=chat_template)
    accuracy = answer_accuracy(task, answers, problems)
    if not hasattr(task, "answer_kind"):
        return accuracy, None
    kinds = Counter(task.answer_kind(p, text) for text, p in zip(answers, problems))
    return accuracy, {kind: kinds[kind] for kind in task.ANSWER_KINDS}


def _run_workers(rollout_spec: RolloutSpec, trainer_spec: TrainerSpec, logger: RunLogger,
                 strategy: ParallelStrategy) -> dict:
    ctx = mp.get_context("spawn")
    results, metrics = ctx.Queue(), ctx.Queue()
    trainer: tuple = (run_trainer_worker, trainer_spec, results, metrics)
    if strategy.world_size > 1:  # the trainer process spawns the ranks (runtime.parallel_trainer)
        from runtime.parallel_trainer import run_parallel_trainer

        trainer = (run_parallel_trainer, trainer_spec, results, metrics, strategy)
    procs = [
        ctx.Process(target=_child, args=trainer, name="trainer"),
        ctx.Process(target=_child, args=(run_rollout_worker, rollout_spec, results), name="rollout"),
    ]
    # Idle OpenMP threads of a waiting worker must not spin on the cores the other needs
    # (with k = 0 both processes hold all cores); children read this at their start.
    previous = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = previous or "PASSIVE"
    try:
        for p in procs:
            p.start()
    finally:
        if previous is None:
            del os.environ["OMP_WAIT_POLICY"]
    done: dict = {}
    try:
        while len(done) < len(procs):
            try:
                logger.log_step(metrics.get(timeout=0.2))
                continue
            except queue.Empty:
                pass
            try:
                name, status, payload = results.get_nowait()
            except queue.Empty:
                dead = [p.name for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise WorkerFailed(f"worker(s) {dead} died without a report (exit codes "
                                       f"{[p.exitcode for p in procs]})")
                continue
            if status == "error":
                raise WorkerFailed(f"{name} failed:\n{payload}")
            done[name] = payload
        while True:  # metrics still queued after the trainer reported
            try:
                logger.log_step(metrics.get_nowait())
            except queue.Empty:
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=5 if done else 0.5)
            if p.is_alive():
                p.terminate()
                p.join()
    return done
