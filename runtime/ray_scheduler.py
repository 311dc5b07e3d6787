"""The Ray scheduler: run a plan on a Ray cluster (``scheduler.type=ray``).

Owns the run's lifecycle on Ray: connect (``runtime.ray_cluster``), check the cluster
against the plan before any model is touched, make one placement group per device mesh,
start one actor (``runtime.ray_workers.WorkerActor``) per generation replica and per other
worker group of the plan's topology (``runtime.topology``) in its mesh's group — the same
worker code as the local scheduler (``runtime.workers``), a multi-rank trainer spawning its
ranks inside its actor on the mesh's resources — run the router on the driver, show
progress, and leave no actor or placement group
behind, also on Ctrl-C. What happens before and after the workers (plan.json, warm start,
held-out accuracy, summary) is :class:`runtime.run_setup.RunSetup`, shared with ``local``.

Co-located groups (``|``) share their mesh's bundle on Ray but do not take turns (the local
scheduler's lock is a process lock); the plan's time-sharing is then only approximate.

Transport: pyzmq channels on TCP between the nodes' IPs (not the object store): the
semantics the runtime relies on (FIFO with back-pressure, admission indices, exactly-once
checks, versioned and checksummed weight buckets) are the channels', and the driver stays
out of the data path except for the router's small messages and per-step metrics.

Fault tolerance: Ray restarts a dead generation replica in its bundle (up to
``scheduler.max_restarts`` times); the driver reruns it on the same addresses, waiting for
the trainer's current version (which the trainer republishes on a ``resync`` message), and
the router sends it again every group it held, under the same indices; a group delivered
twice is dropped by the trainer. Any other actor's death fails the run.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import cloudpickle
import ray
import ray.cloudpickle
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from compiler.plan import Plan
from runtime.launch import WorkerFailed
from runtime.run_setup import RunSetup
from runtime.metrics import RunLogger
from runtime.ray_cluster import ClusterMismatchError, connect, create_placement_group, device_resource, plan_nodes
from runtime.ray_workers import WorkerActor, free_tcp_endpoint

NAMESPACE = "areal_flow"
POLL_S = 0.5
RESTART_TIMEOUT_S = 300.0  # seconds for Ray to bring a dead replica back


def share_pickle_by_value() -> None:
    """Pickle by value, in Ray too, the modules registered with ``cloudpickle`` for it
    (graph files: ``areal_flow.cli.load_flow``); Ray's vendored cloudpickle has its own registry."""
    for name in cloudpickle.list_registry_pickle_by_value():
        if name in sys.modules:
            ray.cloudpickle.register_pickle_by_value(sys.modules[name])


def _settings(plan: Plan) -> SimpleNamespace:
    """The config-shaped view ``runtime.ray_cluster`` reads (scheduler and cluster)."""
    return SimpleNamespace(scheduler=SimpleNamespace(**plan.run["scheduler"]), cluster=SimpleNamespace(**plan.cluster),
                           name=plan.run["name"])


def run_on_ray(plan: Plan, show_progress: bool = True) -> dict:
    """Run ``plan`` on Ray; returns the local scheduler's summary plus ``ray`` (address,
    placement of the actors).

    Raises:
        runtime.ray_cluster.RayClusterUnreachable / ClusterMismatchError: before any model
            is touched.
        WorkerFailed: a worker raised or died.
    """
    setup = RunSetup.create(plan, show_progress)
    share_pickle_by_value()
    cfg = _settings(plan)
    connection = connect(cfg)
    run = _RayRun(setup, cfg)
    try:
        run.place(plan_nodes(cfg))
        setup.prepare()
        return run.execute(connection)
    finally:
        run.cleanup()
        connection.close()


class _RayRun:
    def __init__(self, setup: RunSetup, cfg) -> None:
        self.setup, self.cfg = setup, cfg
        self.resource = device_resource(cfg)
        self.pgs: dict = {}
        self.actors: dict[str, object] = {}
        self.steps_done, self.last_checkpoint = 0, None
        self.restarts = 0
        self.trainer: str | None = None

    def place(self, nodes: list[str]) -> None:
        """One placement group per distinct device mesh of the plan (fails when taken)."""
        for node in self.setup.plan.nodes:
            if node.strategy is not None and node.mesh not in self.pgs:
                self.pgs[node.mesh] = create_placement_group(
                    node.mesh, nodes, self.resource, f"{NAMESPACE}/{self.cfg.name}/{node.mesh.label()}",
                    self.cfg.scheduler.placement_timeout_s)

    def _actor(self, name: str, mesh, share: int, restarts: int = 0):
        amount = mesh.n_devices / share
        opts: dict = dict(name=f"{self.cfg.name}/{name}", namespace=NAMESPACE, max_concurrency=4, max_restarts=restarts,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(self.pgs[mesh],
                                                                               placement_group_bundle_index=0))
        if self.resource == "CPU":
            opts["num_cpus"] = amount
        else:
            opts["num_cpus"] = 1.0 / share
            opts["num_gpus" if self.resource == "GPU" else "resources"] = (
                amount if self.resource == "GPU" else {self.resource: amount})
        return ray.remote(WorkerActor).options(**opts).remote()

    def execute(self, connection) -> dict:
        setup, topo = self.setup, self.setup.topo
        sharing: dict = {}
        for g in topo.groups.values():
            sharing[g.mesh] = sharing.get(g.mesh, 0) + g.replicas
        for g in topo.groups.values():
            for r in range(g.replicas):
                restarts = int(self.cfg.scheduler.max_restarts) if g.kind == "generation" else 0
                self.actors[f"{g.name}/{r}"] = self._actor(f"{g.name}/{r}", g.mesh, sharing[g.mesh], restarts)
        host = self._bind_host()
        addresses = {g.name: [ray.get(self.actors[f"{g.name}/{r}"].endpoint.remote(host)) for r in range(g.replicas)]
                     for g in topo.groups.values()}
        gen = topo.generation
        addresses["weights"] = [ray.get(self.actors[f"{gen.name}/{r}"].endpoint.remote(host))
                                for r in range(gen.replicas)]
        control = free_tcp_endpoint(host)
        specs = setup.specs(addresses, control, threads=1)
        specs = [replace(s, out_dir=str(setup.out_dir)) for s in specs]
        router = setup.router(addresses[gen.name], control)
        stop = threading.Event()
        router_thread = threading.Thread(target=router.run, args=(stop,), daemon=True)
        router_thread.start()
        logger = setup.logger()
        try:
            workers = self._drive(specs, logger, router)
        except KeyboardInterrupt:
            if self.trainer is not None:  # the metrics (and checkpoints) the trainer has reported but we not yet read
                self._pull(logger, self.trainer, timeout_s=10)
            logger.close()
            self.cleanup()
            note = (f"last checkpoint: {self.last_checkpoint}" if self.last_checkpoint else
                    "no checkpoint was saved (train.checkpoint_every)")
            print(f"\nareal-flow: interrupted after {self.steps_done} of {topo.steps} steps; {note}", file=sys.stderr)
            raise
        except BaseException:
            logger.close()
            raise
        finally:
            stop.set()
            router_thread.join(timeout=10)
            setup.merge_trace()
        placement = {name: {**ray.get(a.where.remote()), "mesh": topo.groups[name.rsplit("/", 1)[0]].mesh.label()}
                     for name, a in self.actors.items()}
        self.cleanup()  # free the cluster before the held-out evaluation
        workers["router"] = {"dispatched": router.dispatched, "resampled": router.resampled,
                             "redispatched": router.redispatched, "rejected_messages": router.rejected}
        return setup.finish(logger, workers, ray={"address": connection.address or "local", "placement": placement,
                                                  "last_checkpoint": self.last_checkpoint,
                                                  "replica_restarts": self.restarts})

    def _bind_host(self) -> str:
        """``scheduler.bind_host``; loopback (empty) only when every actor is on this machine
        (its node's IP is the driver's: raylets sharing one machine qualify).

        Raises:
            ClusterMismatchError: actors on other machines with channels bound to loopback.
        """
        host = getattr(self.cfg.scheduler, "bind_host", "")
        here = ray.util.get_node_ip_address()
        away = sorted({w["ip"] for w in ray.get([a.where.remote() for a in self.actors.values()]) if w["ip"] != here})
        if not host and away:
            raise ClusterMismatchError(f"workers placed on other nodes ({', '.join(away)}) cannot reach channels bound "
                                       "to loopback: set scheduler.bind_host=node (or an interface's IP)")
        return host

    def _drive(self, specs, logger: RunLogger, router) -> dict:
        topo = self.setup.topo
        by_name = {f"{s.group}/{s.rank}": s for s in specs}
        trainer = self.trainer = next(n for n, s in by_name.items() if topo.groups[s.group].batch_nodes)
        pending = {self.actors[n].run.remote(s, topo.groups[s.group].kind == "generation"): n for n, s in by_name.items()}
        results: dict = {}
        while trainer not in results:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            self._pull(logger, trainer)
            for ref in ready:
                name = pending.pop(ref)
                try:
                    results[name] = ray.get(ref)
                except RayTaskError as exc:
                    raise WorkerFailed(f"{name} failed:\n{exc}") from None
                except RayActorError as exc:
                    spec = by_name[name]
                    if topo.groups[spec.group].kind != "generation":
                        raise WorkerFailed(f"the {name} actor died: {exc}") from None
                    spec = by_name[name] = self._restart(name, spec, router, by_name[trainer].inbox, exc)
                    pending[self.actors[name].run.remote(spec, True)] = name
        self._pull(logger, trainer)
        return results

    def _restart(self, name: str, spec, router, trainer_inbox: str, exc: Exception):
        """Wait for Ray to bring the replica back; its spec with the version to resume at."""
        self.restarts += 1
        limit = int(self.cfg.scheduler.max_restarts)
        if self.restarts > limit:
            raise WorkerFailed(f"generation replicas died {self.restarts} times (scheduler.max_restarts={limit}): {exc}")
        version = router.versions.get(spec.rank, 0)
        print(f"areal-flow: {name} died; Ray restarts it at policy version {version} ({self.restarts}/{limit})",
              file=sys.stderr)
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:  # calls fail until Ray marks the actor restarting; then they wait for it
            try:
                ray.get(self.actors[name].where.remote(), timeout=RESTART_TIMEOUT_S)
                break
            except (RayActorError, GetTimeoutError):
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"{name} did not come back within {RESTART_TIMEOUT_S:g} s: {exc}") from None
                time.sleep(POLL_S)
        router.replace_replica(spec.rank, spec.inbox)
        return replace(spec, resume_version=version, resync=trainer_inbox)

    def _pull(self, logger: RunLogger, trainer: str, timeout_s: float = 60) -> None:
        try:
            for metrics in ray.get(self.actors[trainer].metrics.remote(), timeout=timeout_s):
                logger.log_step(metrics)
                self.steps_done = metrics["step"] + 1
                self.last_checkpoint = metrics.get("checkpoint", self.last_checkpoint)
        except (RayActorError, GetTimeoutError):
            return

    def cleanup(self) -> None:
        """Kill the actors and remove the placement groups (idempotent)."""
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        for pg in self.pgs.values():
            try:
                remove_placement_group(pg)
            except Exception:  # already removed
                pass
        self.actors, self.pgs = {}, {}
