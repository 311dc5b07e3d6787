"""Ray actors hosting the two workers: the rollout worker and the trainer worker.

Owns only the hosting: each actor runs the same worker function the local scheduler runs
(``runtime.rollout_worker`` / ``runtime.trainer_worker``) in its own process, on the node
of its placement group, and answers the driver's small calls. The actors are plain
classes here; ``runtime.ray_scheduler`` wraps them with ``ray.remote`` and its options.

Channel endpoints: a worker binds the receiving end of its channel (the trainer the
experience channel, the rollout worker the weight channel) on its node's IP as Ray knows
it (``ray.util.get_node_ip_address``), so the peer can reach it from another node.
"""

from __future__ import annotations

import queue
import socket
import threading
import time

import ray

from runtime.rollout_worker import RolloutResume, RolloutSpec, run_rollout_worker
from runtime.trainer_worker import TrainerSpec, run_trainer_worker


def free_tcp_endpoint() -> str:
    """``tcp://<this node's IP>:<port>`` with a port the OS reported free just now.

    The port is bound again by the worker a moment later; another process taking it in
    between makes the worker fail with ``ValueError`` naming the address (not seen in
    practice: the OS hands out ephemeral ports round-robin).
    """
    ip = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        port = s.getsockname()[1]
    return f"tcp://[{ip}]:{port}" if family == socket.AF_INET6 else f"tcp://{ip}:{port}"


def _where() -> dict:
    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}


class RolloutActor:
    """Runs :func:`run_rollout_worker`; Ray restarts it (same placement) when it dies."""

    def where(self) -> dict:
        """``{"node_id", "ip"}`` of the node it runs on."""
        return _where()

    def endpoint(self) -> str:
        """A fresh weight-channel address on this node (see :func:`free_tcp_endpoint`)."""
        return free_tcp_endpoint()

    def run(self, spec: RolloutSpec, resume: RolloutResume | None = None) -> dict:
        return run_rollout_worker(spec, resume)


class TrainerActor:
    """Runs :func:`run_trainer_worker` in one thread; other calls (metrics, resync) are
    served concurrently (the actor is created with ``max_concurrency > 1``)."""

    def __init__(self) -> None:
        self._metrics: queue.Queue = queue.Queue()
        self._resync: queue.Queue = queue.Queue()
        self._finished = threading.Event()

    def where(self) -> dict:
        """``{"node_id", "ip"}`` of the node it runs on."""
        return _where()

    def endpoint(self) -> str:
        """A fresh experience-channel address on this node (see :func:`free_tcp_endpoint`)."""
        return free_tcp_endpoint()

    def run(self, spec: TrainerSpec) -> dict:
        try:
            return run_trainer_worker(spec, self._metrics, resync=self._resync)
        finally:
            self._finished.set()

    def metrics(self) -> list[dict]:
        """Per-step metrics put since the last call, oldest first."""
        out = []
        while True:
            try:
                out.append(self._metrics.get_nowait())
            except queue.Empty:
                return out

    def resync(self, weight_address: str, timeout_s: float) -> dict | None:
        """For a restarted rollout worker at ``weight_address``: ``{"held", "version"}`` (see
        ``runtime.trainer_worker._serve_resync``), or None when training already finished.

        Raises:
            TimeoutError: the trainer did not answer within ``timeout_s`` seconds.
        """
        reply: queue.Queue = queue.Queue()
        self._resync.put((weight_address, reply))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return reply.get(timeout=0.2)
            except queue.Empty:
                if self._finished.is_set():
                    return None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"trainer did not answer a resync request within {timeout_s} s") from None
