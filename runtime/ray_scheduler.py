"""The Ray scheduler: run a plan on a Ray cluster (``scheduler.type=ray``).

Owns the run's lifecycle on Ray and :class:`RayScheduler`, the ``ray``
:class:`runtime.driver.Scheduler`: connect (``runtime.ray_cluster``), check the cluster
against the plan before any model is touched, make one placement group per device mesh,
start one actor (``runtime.ray_workers.WorkerActor``) per generation replica and per other
worker group of the plan's topology (``runtime.topology``) in its mesh's group — the same
worker code as the local scheduler (``runtime.workers``), a multi-rank trainer spawning its
ranks inside its actor on the mesh's resources, or, its mesh spanning machines, inside one
actor per machine (``runtime.ray_ranks``) — and leave no actor or placement group
behind, also on Ctrl-C. What the schedulers share is written once: what happens before and
after the workers (plan.json, warm start, held-out accuracy, summary) in
:class:`runtime.run_setup.RunSetup`; the attempt loop, the router (on the driver), restarts,
which group is the trainer, progress and the stop in :class:`runtime.driver.Driver`.

Co-located groups (``|``) share their mesh's bundle on Ray but do not take turns (the local
scheduler's lock is a process lock); the plan's time-sharing is then only approximate.

Transport: pyzmq channels on TCP between the nodes' IPs (not the object store): the
semantics the runtime relies on (FIFO with back-pressure, admission indices, exactly-once
checks, versioned and checksummed weight buckets) are the channels', and the driver stays
out of the data path except for the router's small messages and per-step metrics.

Fault tolerance, within ``scheduler.max_restarts`` in all (``runtime.restarts``, shared
with the local scheduler): Ray restarts a dead generation replica in its bundle (the
scheduler waits for it, :meth:`RayScheduler.revive`); the driver reruns it on the same addresses, waiting for the trainer's current version (which the
trainer republishes on a ``resync`` message), and the router sends it again every group it
held, under the same indices; a group delivered twice is dropped by the trainer. When the
trainer's actor (or another stage worker's) dies, the driver kills every actor of the
attempt and starts them all again, in the same placement groups, from the run's last
complete checkpoint, as the local scheduler does; a resumed run (``--resume``) starts from
it the same way. A lost node (its actors dead with it) does the same: the plan machine it
stood for moves to a spare alive node (its meshes' placement groups made again there) before
the actors start again, or, with no spare node, the run stops naming the node and the plan's
devices it held (:class:`runtime.ray_cluster.NodeLost`). The trainer reports each step's
metrics into a queue actor the driver reads (``ray.util.queue.Queue``), which outlives a
dead trainer.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.queue import Queue
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from compiler.hosting import ray_machine_problem
from compiler.plan import Plan
from runtime.checkpoint import latest_checkpoint
from runtime.driver import DIED, OK, Driver, WorkerEnd, reports
from runtime.restarts import HostLost, ReportsLost, StageDied, WorkerFailed
from runtime.ray_exits import exit_cause
from runtime.parallel.launch import RankKilled
from runtime.ray_ranks import RankHosts, actor_names, rank_specs, spans_machines
from runtime.run_setup import RunSetup
from runtime.ray_cluster import (ClusterMismatchError, NodeLost, connect, create_placement_group, device_resource,
                                 lost_machines, plan_nodes, share_pickle_by_value, spare_nodes)
from runtime.ray_workers import WorkerActor, free_tcp_endpoint
from runtime.topology import WorkerGroup
from runtime.workers import WorkerSpec

NAMESPACE = "areal_flow"
POLL_S = 0.5
RESTART_TIMEOUT_S = 300.0  # seconds for Ray to bring a dead replica back
NODE_CHECK_S = 2.0  # seconds between checks that the plan machines' nodes live, while waiting on actors
NODE_DEAD_S = 60.0  # an actor died while starting: seconds for the GCS to mark its node dead (health checks)


def _settings(plan: Plan) -> SimpleNamespace:
    """The config-shaped view ``runtime.ray_cluster`` reads (scheduler and cluster)."""
    return SimpleNamespace(scheduler=SimpleNamespace(**plan.run["scheduler"]), cluster=SimpleNamespace(**plan.cluster),
                           name=plan.run["name"])


def run_on_ray(setup: RunSetup) -> dict:
    """Run the plan of ``setup`` (``RunSetup.create``: a new run, or a resumed one) on Ray;
    returns the local scheduler's summary plus ``ray`` (address, placement of the actors,
    last checkpoint).

    Raises:
        runtime.ray_cluster.RayClusterUnreachable / ClusterMismatchError: before any model
            is touched.
        WorkerFailed: a worker raised, or workers died more often than ``scheduler.max_restarts``.
    """
    share_pickle_by_value()
    cfg = _settings(setup.plan)
    connection = connect(cfg)
    scheduler = RayScheduler(setup, cfg, connection.address or "local")
    try:
        scheduler.place(plan_nodes(cfg))
        setup.prepare()
        return Driver(setup, scheduler).execute()
    finally:
        scheduler.release()
        connection.close()


class RayScheduler:
    """The ``ray`` :class:`runtime.driver.Scheduler`: one actor per worker in its mesh's
    placement group (generation replicas restartable by Ray, within the restart budget),
    pyzmq TCP channels between the actors' nodes, step metrics through a queue actor that
    outlives a dead trainer, a death noticed as Ray's ``RayActorError``."""

    restart_how, start_how = "Ray restarts it", "starting {n} workers (Ray actors: torch, models)"

    def __init__(self, setup: RunSetup, cfg, address: str = "local") -> None:
        self.setup, self.cfg, self.address = setup, cfg, address
        self.resource = device_resource(cfg)
        self.pgs: dict = {}
        self.nodes: list[str] = []  # the Ray node id standing for each plan machine
        self.actors: dict[str, object] = {}
        self.pending: dict = {}  # object ref of a worker's run -> its name
        self.hosts = RankHosts(exit_cause)  # a trainer's ranks on its mesh's other machines
        self.placement: dict = {}
        self.sink: Queue | None = None
        self.held: list = []  # sockets holding the ports of the router's control addresses

    def place(self, nodes: list[str]) -> None:
        """One placement group per distinct device mesh of the plan, plan machine ``i`` on Ray
        node ``nodes[i]`` (fails when taken, or when a mesh's workers cannot share its
        machines: :meth:`layout`)."""
        self.layout()
        self.nodes = list(nodes)
        for node in self.setup.plan.nodes:
            if node.strategy is not None and node.mesh not in self.pgs:
                self.pgs[node.mesh] = self._group(node.mesh)

    def _group(self, mesh):
        return create_placement_group(mesh, self.nodes, self.resource, f"{NAMESPACE}/{self.cfg.name}/{mesh.label()}",
                                      self.cfg.scheduler.placement_timeout_s)

    def _replace_lost_nodes(self) -> None:
        """Stand a spare alive node in for each plan machine whose node died, and make the
        placement groups of the meshes on those machines again there (no actor may be running).

        Raises:
            NodeLost: fewer spare nodes than lost ones; names the lost nodes and the plan's
                devices (meshes) that can no longer be placed.
        """
        lost = lost_machines(self.nodes)
        if not lost:
            return
        meshes = [m for m in self.pgs if any(m.first_node <= i < m.first_node + m.n_nodes for i in lost)]
        devices = ", ".join(m.label() for m in meshes)
        gone = ", ".join(f"{where} (plan machine n{i})" for i, where in lost.items())
        spares = spare_nodes(self.cfg, self.nodes)
        if len(spares) < len(lost):
            raise NodeLost(
                f"Ray node {gone} was lost and no other alive node offers cluster.n_gpus_per_node="
                f"{self.cfg.cluster.n_gpus_per_node} '{self.resource}': the plan's devices {devices} can no longer be "
                f"placed; `--resume {self.setup.out_dir}` continues from the last checkpoint once the cluster has them")
        for i, node in zip(lost, spares):
            self.nodes[i] = node
        for mesh in meshes:
            remove_placement_group(self.pgs.pop(mesh))
            self.pgs[mesh] = self._group(mesh)
        moved = ", ".join(f"n{i} -> {self.nodes[i][:8]}" for i in lost)
        print(f"areal-flow: Ray node {gone} was lost; the plan's devices {devices} move to a spare node ({moved})",
              file=sys.stderr)

    def _get(self, refs: list) -> list:
        """``ray.get(refs)``, checking while it waits that every plan machine's node is alive.

        Raises:
            HostLost: a node died meanwhile (an actor there would never start), or an actor died and
                a node is found dead within ``NODE_DEAD_S`` (Ray fails actors of a node not yet marked dead).
            RayActorError: an actor died, every node alive (at once when its ``__init__`` raised).
        """
        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=NODE_CHECK_S)
            if len(ready) == len(refs):
                try:
                    return ray.get(refs)
                except RayActorError as exc:
                    if exc.actor_init_failed:  # its own __init__ raised: no node to wait for
                        raise
                    deadline = time.monotonic() + NODE_DEAD_S
                    while not (lost := lost_machines(self.nodes)) and time.monotonic() < deadline:
                        time.sleep(POLL_S)
                    if not lost:
                        raise
            else:
                lost = lost_machines(self.nodes)
            if lost:
                raise HostLost(f"node {', '.join(lost.values())} was lost")

    def layout(self) -> dict[str, tuple]:
        """Each actor's ``(mesh, bundle, actors sharing that bundle)``: each group's actors
        (``runtime.ray_ranks.actor_names``: its replicas, or a trainer's one actor per machine)
        are spread evenly over the bundles of the machines its mesh spans, the ``k``-th on bundle
        ``k // (actors / machines)``, so generation replica ``r`` runs on the machine that holds
        its devices; the groups time-sharing a mesh share its bundles' devices evenly.

        Raises:
            ClusterMismatchError: a worker group breaks ``compiler.hosting``'s rule
                ``ray-one-machine`` (e.g. a judge spanning machines: its processes are those of
                its one actor), naming the group's node and the rule.
        """
        bundle_of: dict = {}
        for g in self.setup.topo.groups.values():
            names = actor_names(g)
            why = ray_machine_problem(len(names), g.mesh.label(), g.mesh.n_nodes)
            if why is not None:
                raise ClusterMismatchError(f"node '{g.name}': {why}")
            per = len(names) // g.mesh.n_nodes
            bundle_of.update((name, (g.mesh, k // per)) for k, name in enumerate(names))
        share: dict = {}
        for where in bundle_of.values():
            share[where] = share.get(where, 0) + 1
        return {name: (mesh, bundle, share[mesh, bundle]) for name, (mesh, bundle) in bundle_of.items()}

    def _actor(self, name: str, restarts: int = 0):
        mesh, bundle, share = self.layout()[name]
        amount = mesh.n_devices / share
        opts: dict = dict(name=f"{self.cfg.name}/{name}", namespace=NAMESPACE, max_concurrency=4, max_restarts=restarts,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(self.pgs[mesh],
                                                                               placement_group_bundle_index=bundle))
        if self.resource == "CPU":
            opts["num_cpus"] = amount
        else:
            opts["num_cpus"] = 1.0 / share
            opts["num_gpus" if self.resource == "GPU" else "resources"] = (
                amount if self.resource == "GPU" else {self.resource: amount})
        return ray.remote(WorkerActor).options(**opts).remote()

    def _start_actors(self) -> None:
        """One actor per worker of the topology in its mesh's placement group, on its bundle
        (:meth:`layout`; generation replicas restartable by Ray); a bundle's devices are split
        evenly among its actors."""
        limit = int(self.setup.plan.run["scheduler"].get("max_restarts", 0))
        for g in self.setup.topo.groups.values():
            for name in actor_names(g):
                self.actors[name] = self._actor(name, limit if g.kind == "generation" else 0)

    def addresses(self) -> tuple[dict[str, list[str]], str, int]:
        """Start the attempt's actors (and, once, the metrics queue) on the plan machines' nodes,
        replacing lost ones first (:meth:`_replace_lost_nodes`; again when one dies while the
        actors start); their channel endpoints.

        Raises:
            NodeLost: a plan machine's node is gone and no spare node can stand in.
            ClusterMismatchError: actors on other machines with channels bound to loopback.
            StageDied: an actor died while starting, every node alive (killed, a crash): the
                driver restarts every worker from the last checkpoint, within ``scheduler.max_restarts``.
            RayActorError: an actor's ``__init__`` raised.
        """
        topo, gen = self.setup.topo, self.setup.topo.generation
        if self.sink is None:
            # Outside the placement groups (it holds no device), on the driver's node: lost only with the driver.
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self.sink = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})
        while True:
            self._replace_lost_nodes()
            self._start_actors()
            try:
                host = self._bind_host()
                addresses = {g.name: self._get([self.actors[f"{g.name}/{r}"].endpoint.remote(host)
                                                for r in range(g.replicas)]) for g in topo.groups.values()}
                addresses["weights"] = self._get([self.actors[f"{gen.name}/{r}"].endpoint.remote(host)
                                                  for r in range(gen.replicas)])
                break
            except HostLost:
                self.stop(wait=True)
            except RayActorError as exc:  # killed while starting, every node alive: a restart, counted
                if exc.actor_init_failed:  # its own __init__ raised: a bug or a bad setting, not a death
                    raise
                self.stop(wait=True)
                name = next((n for n, a in self.actors.items() if a._actor_id.hex() == exc.actor_id), exc.actor_id)
                raise StageDied(name, f"{exit_cause(exc)}, while the actors started", 0) from None
        threads = int(self.setup.plan.run["scheduler"].get("threads_per_worker", 0)) or 1  # 0: one per actor's CPU
        return addresses, free_tcp_endpoint(host, self.held), threads

    def _bind_host(self) -> str:
        """``scheduler.bind_host``; loopback (empty) only when every actor is on this machine
        (its node's IP is the driver's: raylets sharing one machine qualify). Notes where each
        actor runs (the summary's ``placement``).

        Raises:
            ClusterMismatchError: actors on other machines with channels bound to loopback.
        """
        host = getattr(self.cfg.scheduler, "bind_host", "")
        here = ray.util.get_node_ip_address()
        where = dict(zip(self.actors, self._get([a.where.remote() for a in self.actors.values()])))
        self.placement = {name: {**w, "mesh": self.setup.topo.groups[name.rsplit("/", 1)[0]].mesh.label()}
                          for name, w in where.items()}
        away = sorted({w["ip"] for w in where.values() if w["ip"] != here})
        if not host and away:
            raise ClusterMismatchError(f"workers placed on other nodes ({', '.join(away)}) cannot reach channels bound "
                                       "to loopback: set scheduler.bind_host=node (or an interface's IP)")
        return host

    def start(self, spec: WorkerSpec, group: WorkerGroup) -> None:
        name = f"{spec.group}/{spec.rank}"
        generation = group.kind == "generation"
        sink = self.sink if reports(self.setup.topo, group) else None  # one rule with the local scheduler
        if spans_machines(group):  # its ranks on every machine of its mesh, joined at rank 0's
            master, port = ray.get(self.actors[name].rendezvous.remote(getattr(self.cfg.scheduler, "bind_host", "")))
            specs = rank_specs(spec, group, master, port)
            spec = specs.pop(name)
            for host, host_spec in specs.items():
                self.hosts.started(self.actors[host].run_ranks.remote(host_spec), host, name)
        self.pending[self.actors[name].run.remote(spec, generation, sink)] = name

    def wait(self, timeout_s: float) -> list[WorkerEnd]:
        """The workers that ended within ``timeout_s`` seconds; a trainer's rank host ending is
        reported as its stage worker's end (``runtime.ray_ranks.RankHosts``), or not at all."""
        if not self.pending:
            return []
        ready, _ = ray.wait(list(self.pending) + self.hosts.refs(), num_returns=1, timeout=timeout_s)
        ended = []
        for ref in ready:
            if ref not in self.pending:
                end = self.hosts.end(ref)
                if end is not None:  # its stage worker's later end (an error in a collective) is not
                    self.pending = {r: n for r, n in self.pending.items() if n != end.name}
                    ended.append(end)
                continue
            name = self.pending.pop(ref)
            try:
                ended.append(WorkerEnd(name, OK, ray.get(ref)))
            except RayTaskError as exc:  # a rank ended by a signal (RankKilled): as RankHosts.end says, a death
                ended.append(WorkerEnd(name, DIED, str(exc.cause)) if isinstance(exc.cause, RankKilled)
                             else self.hosts.lead_error(name, str(exc)))
            except RayActorError as exc:
                ended.append(WorkerEnd(name, DIED, exit_cause(exc)))
        return ended

    def metrics(self) -> list[dict]:
        """The step reports in the metrics queue (none once it is lost, until the next attempt).

        Raises:
            ReportsLost: the queue's actor died (its process killed); the next attempt's
                :meth:`addresses` starts a new one.
        """
        if self.sink is None:
            return []
        try:
            waiting = self.sink.qsize()
            return self.sink.get_nowait_batch(waiting) if waiting else []
        except RayActorError as exc:
            self.sink = None
            raise ReportsLost("metrics queue", exit_cause(exc)) from None

    def revive(self, name: str, cause: str) -> None:
        """Wait for Ray to bring replica ``name`` back in its bundle (its calls fail until Ray
        marks the actor restarting; then they wait for it), checking that its node lives.

        Raises:
            HostLost: its node died (its bundle is pinned there: Ray cannot bring it back).
            WorkerFailed: the actor is not back within ``RESTART_TIMEOUT_S`` seconds.
        """
        machine = self.nodes.index(self.placement[name]["node_id"])
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            lost = lost_machines(self.nodes)
            if machine in lost:
                raise HostLost(f"its node {lost[machine]} (plan machine n{machine}) was lost")
            try:
                ray.get(self.actors[name].where.remote(), timeout=NODE_CHECK_S)
                return
            except (RayActorError, GetTimeoutError):
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"{name} did not come back within {RESTART_TIMEOUT_S:g} s: {cause}") from None
                time.sleep(POLL_S)

    def stop(self, wait: bool) -> None:
        """Kill this attempt's actors (idempotent); with ``wait``, until Ray has them dead
        (their names free for the next attempt's).

        Raises:
            WorkerFailed: one still holds its name after ``RESTART_TIMEOUT_S`` seconds.
        """
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)  # a dead actor's kill is a no-op (Ray 2.60)
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        for name in self.actors if wait else ():
            while True:
                try:
                    ray.get_actor(f"{self.cfg.name}/{name}", namespace=NAMESPACE)
                except ValueError:  # no live actor of that name
                    break
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"actor {self.cfg.name}/{name} still alive {RESTART_TIMEOUT_S:g} s "
                                       "after ray.kill")
                time.sleep(POLL_S / 5)
        self.actors, self.pending = {}, {}
        self.hosts.clear()

    def release(self) -> dict:
        """Kill the actors and the metrics queue, remove the placement groups (idempotent);
        the summary's ``ray`` block: address, where each actor ran, the last checkpoint."""
        self.stop(wait=False)
        if self.sink is not None:
            self.sink.shutdown(force=True)
            self.sink = None
        for pg in self.pgs.values():
            remove_placement_group(pg)  # removing a removed group is a no-op (Ray 2.60)
        for sock in self.held:
            sock.close()
        self.held = []
        self.pgs = {}
        last = latest_checkpoint(self.setup.out_dir)
        return {"ray": {"address": self.address, "placement": self.placement,
                        "last_checkpoint": str(last.folder) if last else None}}
