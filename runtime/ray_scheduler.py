"""The Ray scheduler: run a compiled graph on a Ray cluster (``scheduler.type=ray``).

Owns the run's lifecycle on Ray: connect (``runtime.ray_cluster``), check the cluster
against the plan before any model is touched, make one placement group per device mesh,
start the generation actor in the ``generate`` node's mesh and the training actor in the
``train_step`` node's mesh (``runtime.ray_workers``; they may sit on different Ray nodes),
show progress, restart a dead generation actor without losing or repeating a group, and
leave no actor or placement group behind, also on Ctrl-C. What happens before and after the
workers (plan.json, warm start, held-out accuracy, summary) is shared with the local
scheduler (:class:`runtime.launch.RunSetup`), so both return the same summary.

Transport: the actors talk over the same pyzmq channels as the local runtime, on TCP
between the nodes' IPs, not through the Ray object store. The channels already carry the
semantics the runtime relies on (FIFO delivery with back-pressure, admission indices,
exactly-once checks in the trainer's buffer, versioned weight buckets with xxHash64
checksums, zero-copy tensor frames), so nothing is re-implemented; the driver stays out of
the data path (only per-step metrics, a few hundred bytes, pass through it); and weights go
straight from the trainer to the generator instead of through a plasma store and an extra
copy. The object store would give location transparency, which a bound TCP port gives too.

Fault tolerance: Ray restarts a dead generation actor in its placement bundle (up to
``scheduler.max_restarts`` times). The driver then asks the trainer which admission indices
it holds and its policy version (the trainer also republishes that version to the new
actor's weight address) and reruns the rollout worker with that state
(:class:`runtime.rollout_worker.RolloutResume`): only the missing indices are generated,
under their own numbers, so every group is trained exactly once. The trainer actor is not
restarted (its state is the run); its death fails the run, naming the last checkpoint.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import cloudpickle
import ray
import ray.cloudpickle
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from areal_flow.config import ExperimentConfig
from areal_flow.graph import Graph
from compiler.mesh import MeshSpec
from runtime.launch import RunSetup, WorkerFailed
from runtime.metrics import RunLogger
from runtime.ray_cluster import Connection, connect, create_placement_group, device_resource, plan_nodes
from runtime.ray_workers import RolloutActor, TrainerActor
from runtime.rollout_worker import RolloutResume, RolloutSpec

NAMESPACE = "areal_flow"
RESTART_TIMEOUT_S = 300.0  # seconds for Ray to bring a dead generation actor back and the trainer to answer
RESTART_ERRORS_S = 30.0  # seconds calls to that actor may keep failing before it counts as gone for good
POLL_S = 0.5  # seconds between the driver's metrics polls


def actor_name(cfg: ExperimentConfig, role: str) -> str:
    """Name of a run's actor in the ``areal_flow`` namespace; ``role`` is rollout or trainer."""
    return f"{cfg.name}/{role}"


def share_pickle_by_value() -> None:
    """Pickle by value, in Ray too, the modules registered with ``cloudpickle`` for it.

    ``areal_flow.cli.load_flow`` registers each graph file (its module name cannot be
    imported on a worker) with the ``cloudpickle`` package; Ray serializes with its own
    vendored copy (``ray.cloudpickle``), whose registry is separate.
    """
    for name in cloudpickle.list_registry_pickle_by_value():
        if name in sys.modules:
            ray.cloudpickle.register_pickle_by_value(sys.modules[name])


def run_experiment_on_ray(graph: Graph, cfg: ExperimentConfig, show_progress: bool = True) -> dict:
    """Run ``graph`` with ``cfg`` on a Ray cluster; returns the same summary as the local
    scheduler plus ``ray`` (address, placement of the actors, restarts, last checkpoint).

    Raises:
        GraphError: the graph has a shape the runtime does not run.
        runtime.ray_cluster.RayClusterUnreachable: nothing answers at the address.
        runtime.ray_cluster.ClusterMismatchError: the cluster has fewer nodes/devices than
            ``cluster.*`` says, or they stay taken (both before any model is touched).
        WorkerFailed: a worker raised, the trainer actor died, or the generation actor
            died more than ``scheduler.max_restarts`` times.
        KeyboardInterrupt: Ctrl-C; the actors are stopped first and the last checkpoint
            is printed.
    """
    run = RunSetup.plan_run(graph, cfg, show_progress)
    share_pickle_by_value()
    connection = connect(cfg)
    ray_run = None
    try:
        nodes = plan_nodes(cfg)
        if show_progress:
            reached = "started a local cluster" if connection.started else \
                f"connected to {connection.address or 'the current cluster'}"
            print(f"ray: {reached}; plan machines -> nodes {[n[:8] for n in nodes]}")
        ray_run = _RayRun(run, nodes, connection)
        ray_run.place()  # fails here, before the warm start, when the resources are taken
        run.prepare_policy()
        return ray_run.execute()
    finally:
        if ray_run is not None:
            ray_run.cleanup()
        connection.close()


class _RayRun:
    """One run's placement groups, actors and driver loop."""

    def __init__(self, run: RunSetup, nodes: list[str], connection: Connection) -> None:
        self.run, self.cfg, self.nodes, self.connection = run, run.cfg, nodes, connection
        self.resource = device_resource(run.cfg)
        self.pgs: dict[MeshSpec, object] = {}
        self.actors: list = []
        self.placement: dict[str, dict] = {}
        self.restarts = 0
        self.steps_done = 0
        self.last_checkpoint: str | None = None

    # ------------------------------------------------------------------ placement
    def place(self) -> None:
        """One placement group per distinct device mesh of the plan.

        Raises:
            ClusterMismatchError: a group is not placed within ``scheduler.placement_timeout_s``.
        """
        for node in self.run.plan.nodes:
            if node.role != "cpu" and node.mesh is not None and node.mesh not in self.pgs:
                self.pgs[node.mesh] = create_placement_group(
                    node.mesh, self.nodes, self.resource, f"{NAMESPACE}/{self.cfg.name}/{node.mesh.label()}",
                    self.cfg.scheduler.placement_timeout_s,
                )

    def _options(self, mesh: MeshSpec, share: int, role: str) -> tuple[dict, int]:
        """Actor options in bundle 0 of ``mesh``'s group, taking ``1/share`` of it; and torch threads."""
        amount = mesh.n_devices / share
        opts: dict = dict(
            name=actor_name(self.cfg, role), namespace=NAMESPACE,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pgs[mesh], placement_group_bundle_index=0),
        )
        if self.resource == "CPU":
            opts["num_cpus"] = amount
        else:
            opts["num_cpus"] = 1.0 / share
            if self.resource == "GPU":
                opts["num_gpus"] = amount
            else:
                opts["resources"] = {self.resource: amount}
        return opts, max(1, int(amount)) if self.resource == "CPU" else 1

    def _start_actors(self) -> tuple[object, object, dict]:
        plan, roles = self.run.plan, self.run.roles
        gen_mesh, train_mesh = plan.node(roles.generate.name).mesh, plan.node(roles.train_step.name).mesh
        share = 2 if gen_mesh == train_mesh else 1  # a colocated plan time-shares one mesh
        gen_opts, gen_threads = self._options(gen_mesh, share, "rollout")
        train_opts, train_threads = self._options(train_mesh, share, "trainer")
        rollout = ray.remote(RolloutActor).options(max_restarts=self.cfg.scheduler.max_restarts, **gen_opts).remote()
        trainer = ray.remote(TrainerActor).options(max_restarts=0, max_concurrency=4, **train_opts).remote()
        self.actors = [rollout, trainer]
        self.placement = {"rollout": ray.get(rollout.where.remote()), "trainer": ray.get(trainer.where.remote())}
        for role, mesh in (("rollout", gen_mesh), ("trainer", train_mesh)):
            self.placement[role]["mesh"] = mesh.label()
        return rollout, trainer, {"rollout": gen_threads, "trainer": train_threads}

    # ---------------------------------------------------------------- driver loop
    def execute(self) -> dict:
        rollout, trainer, threads = self._start_actors()
        self.rollout, self.trainer = rollout, trainer
        rollout_spec, trainer_spec = self.run.worker_specs(
            ray.get(trainer.endpoint.remote()), ray.get(rollout.endpoint.remote()), threads=1)
        rollout_spec = replace(rollout_spec, threads=threads["rollout"])
        trainer_spec = replace(trainer_spec, threads=threads["trainer"],
                               out_dir=str(Path(trainer_spec.out_dir).resolve()))  # actors' cwd differs
        logger = RunLogger(self.run.out_dir, self.cfg.train.steps, self.run.show_progress)
        try:
            workers = self._drive(rollout_spec, trainer_spec, logger)
        except KeyboardInterrupt:
            try:
                self._pull_metrics(logger, timeout_s=5.0)
            except Exception:  # best effort: the workers may have seen the signal too
                pass
            logger.close()
            self.cleanup()
            print(f"\nareal-flow: interrupted after {self.steps_done} of {self.cfg.train.steps} steps; "
                  f"{self._checkpoint_note()}", file=sys.stderr)
            raise
        except BaseException:
            logger.close()
            raise
        self.cleanup()  # free the cluster before the held-out evaluation
        return self.run.finish(logger, workers, ray={
            "address": self.connection.address or "local", "placement": self.placement,
            "rollout_restarts": self.restarts, "last_checkpoint": self.last_checkpoint,
        })

    def _checkpoint_note(self) -> str:
        if self.last_checkpoint is None:
            return f"no checkpoint was saved (train.checkpoint_every={self.cfg.train.checkpoint_every})"
        return f"last checkpoint: {self.last_checkpoint} (on node {self.placement['trainer']['ip']})"

    def _drive(self, rollout_spec: RolloutSpec, trainer_spec, logger: RunLogger) -> dict:
        pending = {self.trainer.run.remote(trainer_spec): "trainer", self.rollout.run.remote(rollout_spec): "rollout"}
        results: dict = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            self._pull_metrics(logger)
            for ref in ready:
                role = pending.pop(ref)
                try:
                    results[role] = ray.get(ref)
                except RayTaskError as exc:
                    raise WorkerFailed(f"{role} worker failed:\n{exc}") from None
                except RayActorError as exc:
                    if role == "trainer":
                        raise WorkerFailed(f"the trainer actor died ({exc}); {self._checkpoint_note()}") from None
                    if "trainer" in results:  # training is complete: nothing left to generate for
                        results[role] = {"died_after_training": str(exc)}
                        continue
                    ref = self._restart_rollout(rollout_spec, exc)
                    if ref is not None:
                        pending[ref] = role
        self._pull_metrics(logger)
        return {"run_rollout_worker": results.get("rollout"), "run_trainer_worker": results["trainer"]}

    def _pull_metrics(self, logger: RunLogger, timeout_s: float = 60.0) -> None:
        try:
            steps = ray.get(self.trainer.metrics.remote(), timeout=timeout_s)
        except (RayActorError, GetTimeoutError):
            return  # the trainer's run reference reports its death
        for metrics in steps:
            logger.log_step(metrics)
            self.steps_done = metrics["step"] + 1
            self.last_checkpoint = metrics.get("checkpoint", self.last_checkpoint)

    def _restart_rollout(self, spec: RolloutSpec, exc: Exception):
        """Resume generation on the restarted actor; None when training finished meanwhile."""
        self.restarts += 1
        if self.restarts > self.cfg.scheduler.max_restarts:
            raise WorkerFailed(f"the generation actor died {self.restarts} times "
                               f"(scheduler.max_restarts={self.cfg.scheduler.max_restarts}): {exc}")
        print(f"areal-flow: generation actor died; Ray restarts it ({self.restarts}/"
              f"{self.cfg.scheduler.max_restarts})", file=sys.stderr)
        deadline = time.monotonic() + RESTART_ERRORS_S
        while True:  # calls fail until Ray has marked the actor as restarting; then they wait for it
            try:
                address = ray.get(self.rollout.endpoint.remote(), timeout=RESTART_TIMEOUT_S)
                break
            except GetTimeoutError:
                raise WorkerFailed(f"the generation actor did not come back within {RESTART_TIMEOUT_S:g} s "
                                   "(is its node gone? its bundle is pinned to it)") from None
            except RayActorError as err:
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"the generation actor did not come back: {err}") from None
                time.sleep(POLL_S)
        try:
            state = ray.get(self.trainer.resync.remote(address, RESTART_TIMEOUT_S))
        except (RayTaskError, RayActorError) as err:
            raise WorkerFailed(f"the trainer could not resynchronize the restarted generation actor: {err}") from None
        if state is None:
            return None
        resume = RolloutResume(held=frozenset(state["held"]), version=state["version"])
        return self.rollout.run.remote(replace(spec, weight_address=address), resume)

    def cleanup(self) -> None:
        """Kill the actors and remove the placement groups (idempotent)."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        for pg in self.pgs.values():
            try:
                remove_placement_group(pg)
            except Exception:  # already removed
                pass
        self.actors, self.pgs = [], {}
