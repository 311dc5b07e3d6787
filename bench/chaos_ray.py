"""The multi-node Ray mode of ``bench/chaos.py`` (``--nodes N``): the bench's own cluster of
``N`` raylets on 127.0.0.1, the plan spread over it, and the victims only a cluster offers.

The cluster is ``ray.cluster_utils.Cluster`` (as ``tests/test_ray_nodes.py``'s ``three_nodes``):
every node 1 CPU and one ``gpu_slot`` stand-in device, the head included. The run's plan
(:data:`PLAN`) is ``gen:d1 + train:d2`` over three machines (generation on the head, the
trainer's rank 0 in its stage worker's actor on one worker node, rank 1 in a rank host actor,
``<run>/train_step/0@n1``, on the other; ``runtime/ray_ranks.py``). The victim kinds added to
``bench/chaos_procs.py``'s: a whole worker node removed (its processes SIGKILLed, never the
head's nor the one the bench's own Ray client is attached to; a fresh spare node is added at
once, so the runtime can move the plan machine's devices there), a trainer rank host actor
killed with ``ray.kill``, an actor's worker process (``ray::WorkerActor``, the metrics
queue's ``ray::_QueueActor``) SIGKILLed, and a trainer rank on Ray (a ``multiprocessing``
spawn child of a ``ray::WorkerActor``: the ranks the stage worker's actor and the rank hosts
start) SIGKILLed. Every one of them must be survived by the runtime
(``bench/chaos.py`` resumes only a dead driver).

Owns the cluster and these victims; what the runs left on it (named actors alive, placement
groups not removed, actor processes) is judged by ``bench/chaos_checks.ray_cluster_left``.
Ray is imported on first use (no import side effects; the drawing is pure).
"""

from __future__ import annotations

import random
import signal
import sys
import time
from collections.abc import Mapping, Sequence

import psutil

from bench.chaos_checks import ray_cluster_left

NODE, RANK_HOST, RAY_RANK = "ray worker node", "trainer rank host", "ray trainer rank"
ACTOR_TITLES = {"ray::WorkerActor": "ray worker actor", "ray::_QueueActor": "ray metrics queue"}
NAMESPACE = "areal_flow"
NODE_ARGS = {"num_cpus": 1, "resources": {"gpu_slot": 1}, "node_ip_address": "127.0.0.1"}
PLAN = ["cluster.n_gpus_per_node=1", "scheduler.device_resource=gpu_slot", "compile.allocation=gen:d1 + train:d2",
        "scheduler.bind_host=node", "scheduler.node_ip=127.0.0.1"]
# The driver keeps Ray on loopback as tests/test_ray_scheduler.py's `loopback_ray` does: Ray 2.60
# rewrites a 127.0.0.1 cluster address to the machine's outward IP, where these raylets do not listen.
LOOPBACK_CLI = ("import sys, ray._private.services as s; s.resolve_ip_for_localhost = lambda host: host; "
                "from areal_flow.cli import main; sys.exit(main())")


def draw(rng: random.Random, victims: Mapping[str, Sequence], allowed: str) -> tuple[str, object] | None:
    """One victim: its kind drawn uniformly among the kinds with a live member that ``allowed``
    (``"all"`` or comma-separated kinds) names, then a member of that kind uniformly; None when
    no kind qualifies. Kinds are sorted first, so a seed draws the same victims."""
    kinds = sorted(k for k, members in victims.items() if members and (allowed == "all" or k in allowed.split(",")))
    if not kinds:
        return None
    kind = rng.choice(kinds)
    return kind, rng.choice(list(victims[kind]))


def _spawn_children(actor: psutil.Process) -> list[psutil.Process]:
    """The trainer ranks an actor started (``multiprocessing`` spawn children: the rank host's
    ranks, ``runtime/ray_ranks.py``); its resource tracker and compile workers are not."""
    found = []
    for c in actor.children():
        try:
            if "spawn_main" in " ".join(c.cmdline()):
                found.append(c)
        except psutil.Error:
            continue
    return found


class RayNodes:
    """The bench's cluster: ``n_nodes`` raylets started here, a client attached for ``ray.kill``."""

    def __init__(self, n_nodes: int) -> None:
        import ray
        import ray._private.services as services
        from ray.cluster_utils import Cluster

        if n_nodes < 3:
            raise ValueError(f"--nodes {n_nodes}: the plan gen:d1 + train:d2 needs 3 nodes")
        services.resolve_ip_for_localhost = lambda host: host  # loopback only (LOOPBACK_CLI)
        self.n_nodes = n_nodes
        self.cluster = Cluster(initialize_head=True, head_node_args={**NODE_ARGS, "include_dashboard": False})
        for _ in range(n_nodes - 1):
            self.cluster.add_node(**NODE_ARGS)
        ray.init(address=self.cluster.address, namespace=NAMESPACE, _node_ip_address="127.0.0.1",
                 logging_level="WARNING", log_to_driver=False)
        self.mine = ray._private.worker.global_worker.node._raylet_socket_name  # never removed
        self.spares = 0

    def command(self, cli_args: list[str]) -> list[str]:
        """The driver's command line for ``areal-flow <cli_args>`` against this cluster."""
        return [sys.executable, "-c", LOOPBACK_CLI, *cli_args, *PLAN, f"cluster.n_nodes={self.n_nodes}",
                f"scheduler.address={self.cluster.address}"]

    def _actor_procs(self) -> dict[str, list[psutil.Process]]:
        found: dict[str, list[psutil.Process]] = {kind: [] for kind in ACTOR_TITLES.values()}
        for p in psutil.Process().children(recursive=True):
            try:
                title = " ".join(p.cmdline())
            except psutil.Error:
                continue
            kind = next((k for prefix, k in ACTOR_TITLES.items() if title.startswith(prefix)), "")
            if kind:
                found[kind].append(p)
        found[RAY_RANK] = [c for a in found["ray worker actor"] for c in _spawn_children(a)]
        return found

    def victims(self, run: str) -> dict[str, list]:
        """This cluster's victims of run ``run`` by kind: actor processes, worker nodes, rank hosts."""
        import ray

        found: dict[str, list] = dict(self._actor_procs())
        found[NODE] = [n for n in self.cluster.worker_nodes if n._raylet_socket_name != self.mine]
        try:
            names = ray.util.list_named_actors(all_namespaces=True)
        except Exception:  # the GCS busy or restarting: no rank host drawn this time
            names = []
        found[RANK_HOST] = [n["name"] for n in names if n["name"].startswith(f"{run}/") and "@n" in n["name"]]
        return found

    def kill(self, kind: str, victim) -> int:
        """Kill ``victim`` of ``kind``; returns a pid it had (0: unknown). A removed node is
        replaced by a fresh spare at once."""
        import ray

        if kind == NODE:
            pid = victim.all_processes["raylet"][0].process.pid
            self.cluster.remove_node(victim, allow_graceful=False)
            self.cluster.add_node(**NODE_ARGS)
            self.spares += 1
            return pid
        if kind == RANK_HOST:
            ray.kill(ray.get_actor(victim, namespace=NAMESPACE), no_restart=True)
            return 0
        victim.send_signal(signal.SIGKILL)
        return victim.pid

    def actors_rss(self) -> int:
        """Bytes of RSS of every actor process of the cluster (the run's workers)."""
        total = 0
        for procs in self._actor_procs().values():
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
        return total

    def leaks(self, wait_s: float) -> list[str]:
        """What the runs left on the cluster (``bench/chaos_checks.ray_cluster_left``), waiting
        up to ``wait_s`` seconds for it to go."""
        import ray

        deadline = time.monotonic() + wait_s
        while True:
            left = ray_cluster_left(ray.util.list_named_actors(all_namespaces=True), ray.util.placement_group_table(),
                                    {kind: [p.pid for p in procs] for kind, procs in self._actor_procs().items()})
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(1.0)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
