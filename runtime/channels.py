"""The runtime's message channels: router, generation replicas and worker groups.

One channel per direction and never a shared queue: experience (``GroupItem``s, this module's
:class:`MessageSender` / :class:`MessageReceiver`) flows generator → trainer groups, and admission
messages flow router ↔ replicas; weights and their versions flow trainer → generator on the
weight channel (``runtime.weights``).

Transport: ZeroMQ PUSH (sender, connects) → PULL (receiver, binds). PUSH/PULL over one
connection is reliable and FIFO while both ends live, and PUSH queues messages until
the receiver is up, so a late-binding trainer loses nothing. A message is any picklable
object; trajectories are plain records (no tensors), so standard ``pickle`` is cheap.

Every message travels as two frames, ``[HMAC-SHA256, pickle]`` under the run's secret
(``runtime.channel_auth``); a receiver unpickles nothing whose MAC does not verify: such a
message is dropped and counted (``rejected``). Receivers bind to loopback unless given
an address on another interface.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import uuid
from collections.abc import Sequence

import zmq

from runtime.channel_auth import Signer, Verifier

DEFAULT_LINGER_S = 5.0
"""Seconds :meth:`close` waits for queued messages to be delivered before dropping them."""


def free_tcp_address() -> str:
    """Return ``"tcp://127.0.0.1:PORT"`` with a port the OS reported free just now.

    Another process may take the port before it is bound; a receiver created with
    ``address=None`` binds a random port atomically instead and avoids that race.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def ipc_address(name: str = "channel") -> str:
    """Return a fresh ``"ipc://..."`` endpoint in the temporary directory (Unix only)."""
    path = os.path.join(tempfile.gettempdir(), f"areal_flow-{name}-{uuid.uuid4().hex[:12]}.sock")
    return f"ipc://{path}"


def bind_socket(sock: zmq.Socket, address: str | None) -> str:
    """Bind ``sock`` to ``address`` (``None``: a random loopback TCP port); return the endpoint.

    Raises:
        ValueError: the address cannot be bound (names the address).
    """
    try:
        if address is None:
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            return f"tcp://127.0.0.1:{port}"
        sock.bind(address)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    except zmq.ZMQError as e:
        raise ValueError(f"cannot bind channel to {address!r}: {e}") from e


def close_bound(sock: zmq.Socket, address: str) -> None:
    """Close a bound socket without waiting and remove its ``ipc://`` socket file, if any."""
    sock.close(linger=0)
    if address.startswith("ipc://"):
        try:
            os.unlink(address[len("ipc://"):])
        except FileNotFoundError:
            pass


def _timeout_ms(timeout_s: float | None) -> int:
    return -1 if timeout_s is None else max(0, int(timeout_s * 1000))


def _send_signed(sock: zmq.Socket, signer: Signer, channel: str, payload: bytes) -> None:
    sock.send_multipart(signer.frames(channel, payload))


def _recv_verified(sock: zmq.Socket, verifier: Verifier, timeout_s: float | None) -> object | None:
    """The next message whose MAC verifies, unpickled; None after ``timeout_s`` seconds.
    Messages that fail verification or replay an earlier one are dropped (counted by
    ``verifier``) unread."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not sock.poll(_timeout_ms(remaining), zmq.POLLIN):
            return None
        frames = sock.recv_multipart(copy=False)
        payload = verifier.accept(frames, 1)
        if payload is not None:
            return pickle.loads(payload[0].buffer)


class MessageSender:
    """PUSH end of a runtime message channel (router, replicas, worker groups): any picklable
    object, FIFO, with back-pressure after ``high_water_mark`` messages.

    Args:
        address: the receiver's endpoint. secret: the run's channel secret.
        linger_s: seconds :meth:`close` waits to deliver.
    """

    def __init__(self, address: str, *, secret: bytes, linger_s: float = DEFAULT_LINGER_S,
                 high_water_mark: int = 1000) -> None:
        self.address = address
        self._signer = Signer(secret, f"channel {address}")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, _timeout_ms(linger_s))
        self._sock.setsockopt(zmq.SNDHWM, high_water_mark)
        self._sock.connect(address)

    def send(self, message: object, timeout_s: float | None = 60.0) -> None:
        """Raises TimeoutError: the queue stayed full for ``timeout_s`` (receiver gone or stalled)."""
        self._sock.setsockopt(zmq.SNDTIMEO, _timeout_ms(timeout_s))
        try:
            _send_signed(self._sock, self._signer, self.address, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except zmq.Again as e:
            raise TimeoutError(f"channel {self.address}: message not accepted within {timeout_s} s") from e

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


class MessageReceiver:
    """PULL end of a runtime message channel (binds; ``None`` = a random loopback TCP port);
    ``secret``: the run's channel secret, :attr:`rejected` counts messages that failed it."""

    def __init__(self, address: str | None = None, *, secret: bytes) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address = bind_socket(self._sock, address)
        self._verifier = Verifier(secret, address if address is not None else self.address)

    @property
    def rejected(self) -> int:
        """Messages dropped unread: their MAC did not verify, or they replayed an earlier one."""
        return self._verifier.rejected

    def recv(self, timeout_s: float | None = 0.0) -> object | None:
        """The next authentic message, or None after ``timeout_s`` seconds (0 polls; None
        waits forever); messages failing their MAC are dropped unread and counted."""
        return _recv_verified(self._sock, self._verifier, timeout_s)

    def close(self) -> None:
        close_bound(self._sock, self.address)


def wait_any(receivers: Sequence, timeout_s: float) -> None:
    """Block until one of ``receivers`` (``MessageReceiver`` /
    ``runtime.weight_subscriber.WeightSubscriber``) has a message, or ``timeout_s`` seconds pass."""
    poller = zmq.Poller()
    for receiver in receivers:
        poller.register(receiver._sock, zmq.POLLIN)
    poller.poll(_timeout_ms(timeout_s))
