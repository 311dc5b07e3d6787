"""The Ray actor hosting a worker of the plan: a generation replica, a stage worker, or a
multi-rank trainer's ranks on a machine other than rank 0's (``runtime.ray_ranks``).

Owns only the hosting: each actor runs the same worker function the local scheduler runs
(``runtime.workers``) in its own process, on the node of its placement group, and answers
the driver's small calls. The actor is a plain class here; ``runtime.ray_scheduler`` wraps
it with ``ray.remote`` and its options.

Channel endpoints: a worker binds the receiving ends of its channels (inbox, weights) on
loopback unless ``scheduler.bind_host`` names an interface: ``"node"`` is its node's IP as
Ray knows it (``ray.util.get_node_ip_address``), so peers on other nodes reach it; any
other value is taken as the IP to bind. Every message is authenticated either way
(``runtime.channel_auth``).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import sys
import threading

import ray

from runtime.stage_worker import run_stage_worker
from runtime.trainer_ranks import run_rank_host
from runtime.workers import WorkerSpec, run_generation_replica


LOOPBACK = "127.0.0.1"


def bind_ip(bind_host: str) -> str:
    """The IP ``scheduler.bind_host`` names on this node: ``""`` loopback, ``"node"`` the node's
    IP as Ray knows it, else the value itself."""
    if not bind_host:
        return LOOPBACK
    return ray.util.get_node_ip_address() if bind_host == "node" else bind_host


def free_tcp_endpoint(bind_host: str = "", hold: list | None = None) -> str:
    """``tcp://<IP>:<port>`` (IP from :func:`bind_ip`) with a port the OS handed out just now.

    With ``hold`` (on Linux), the socket that took the port stays bound (appended to ``hold``;
    with ``SO_REUSEADDR``, not listening) until it is closed: the OS gives the port to no one
    else, and the worker's zmq socket (which sets ``SO_REUSEADDR`` as well) can still bind and
    listen there, as Linux allows while no other socket listens on it. Without it, another process may take the port before the worker binds it
    (the worker then fails with ``ValueError`` naming the address; seen once in the tests, on
    a machine shared with other test runs).
    """
    ip = bind_ip(bind_host)
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, 0))
    port = s.getsockname()[1]
    if hold is None or not sys.platform.startswith("linux"):
        s.close()
    else:
        hold.append(s)
    return f"tcp://[{ip}]:{port}" if family == socket.AF_INET6 else f"tcp://{ip}:{port}"


def _where() -> dict:
    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}


class WorkerActor:
    """Runs one worker of the plan (``runtime.workers``): a generation replica or a stage
    worker (the trainer); Ray restarts a replica (same placement) when it dies. Calls other
    than ``run`` (``where``, ``endpoint``) are served concurrently (``max_concurrency > 1``)."""

    def __init__(self) -> None:
        self.held: list[socket.socket] = []  # the ports of this actor's endpoints, held for its life

    def where(self) -> dict:
        """``{"node_id", "ip"}`` of the node it runs on."""
        return _where()

    def endpoint(self, bind_host: str = "") -> str:
        """A fresh channel address on this node, its port held by this actor until it ends
        (see :func:`free_tcp_endpoint`)."""
        return free_tcp_endpoint(bind_host, self.held)

    def rendezvous(self, bind_host: str = "") -> tuple[str, int]:
        """``(IP, port)`` for the ``torch.distributed`` group of a trainer whose rank 0 this actor
        spawns: the IP :func:`bind_ip` names on this node and a port free on it now."""
        ip = bind_ip(bind_host)
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def run_ranks(self, spec: WorkerSpec) -> None:
        """Spawn this machine's ranks ``spec.ranks`` of the trainer ``spec.group`` and follow rank
        0's commands to the trainer's end (``runtime.trainer_ranks.run_rank_host``)."""
        run_rank_host(spec)

    def run(self, spec: WorkerSpec, generation: bool, sink=None) -> dict:
        """Run the worker ``spec`` describes to its end and return its report. A trainer puts
        each step's metrics into ``sink`` (a ``ray.util.queue.Queue`` the driver reads), which
        outlives this actor, so the steps reported before a death are not lost."""
        if generation:
            return run_generation_replica(spec)
        # A multi-rank trainer reports from its rank 0, a child process: through a process
        # queue, drained into the sink by a thread.
        inbox = mp.get_context("spawn").Queue()
        done = threading.Event()

        def drain() -> None:
            while not done.is_set() or not inbox.empty():
                try:
                    metrics = inbox.get(timeout=0.1)
                except queue.Empty:
                    continue
                if sink is not None:
                    sink.put(metrics)

        thread = threading.Thread(target=drain, daemon=True)
        thread.start()
        try:
            return run_stage_worker(spec, inbox.put)
        finally:
            done.set()
            thread.join(timeout=5)
