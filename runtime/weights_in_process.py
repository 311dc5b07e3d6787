"""The weight channel inside one process: the hybrid worker's handoff from trainer to engine.

When the local scheduler runs a generation replica and the trainer in one process
(``runtime.hybrid``) their weight addresses are ``mem://...`` and :func:`open_publisher` /
:func:`open_subscriber` give these classes instead of ``runtime.weights``' ZeroMQ ones: the
trainer's :meth:`InProcessPublisher.publish` puts ``(version, state dict)`` in a slot named
by the address (no packing, hashing, signing or copying through a socket), and the engine's
:meth:`InProcessSubscriber.poll` takes the newest version from it and loads from those
tensors (``GenerationEngine.update_weights`` copies them into its own model). Versions keep
their meaning: they increase, a superseded one is counted in ``dropped_versions``, the tensor
set is checked against the first version's (``runtime.weight_set``), so the staleness
accounting (``runtime.staleness``) is the same as over the wire.

``snapshot=False`` hands over the trainer's own tensors: right when ``max_staleness = 0``,
where the trainer cannot step again before the engine has loaded the version (step ``s + 1``
trains only on samples generated at version ``s + 1``); with ``snapshot=True`` (``k >= 1``)
each tensor is cloned at publish, as the wire format's payload copy does. An in-process
notification socket (``inproc://``, one empty frame per publish) wakes a replica waiting in
``runtime.channels.wait_any``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch
import zmq

from runtime.weight_set import TensorSet
from runtime.weight_wire import cast_on_wire
from runtime.weight_subscriber import VersionedSubscriber, WeightSubscriber
from runtime.weights import WeightPublisher, check_publishable

SCHEME = "mem://"
_SLOTS: dict[str, _Slot] = {}
_SLOTS_LOCK = threading.Lock()


class _Slot:
    """The newest published version of one address: ``(version, state dict)``, and how many were overwritten unread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latest: tuple[int, dict[str, torch.Tensor]] | None = None
        self.overwritten = 0


def _slot(address: str) -> _Slot:
    with _SLOTS_LOCK:
        return _SLOTS.setdefault(address, _Slot())


def _inproc(address: str) -> str:
    return "inproc://" + address.removeprefix(SCHEME)


def open_publisher(address: str | Sequence[str], *, secret: bytes, snapshot: bool = True,
                   dtype: torch.dtype | None = None, **kwargs):
    """A publisher to ``address`` (one or several): an :class:`InProcessPublisher` when every
    address is ``mem://``, else ``runtime.weights.WeightPublisher(address, secret=secret, dtype=dtype, **kwargs)``;
    ``dtype``: the weight matrices are handed over in it (``runtime.weight_wire.cast_on_wire``; ``None``: as they are)."""
    addresses = [address] if isinstance(address, str) else list(address)
    if addresses and all(a.startswith(SCHEME) for a in addresses):
        return InProcessPublisher(addresses, snapshot=snapshot, dtype=dtype)
    return WeightPublisher(address, secret=secret, dtype=dtype, **kwargs)


def open_subscriber(address: str, *, secret: bytes):
    """The subscriber bound at ``address``: in-process for ``mem://``, else ``runtime.weight_subscriber.WeightSubscriber``."""
    return InProcessSubscriber(address) if address.startswith(SCHEME) else WeightSubscriber(address, secret=secret)


class InProcessPublisher:
    """Trainer side (module doc); the interface of ``runtime.weights.WeightPublisher`` that the
    trainer uses. ``published_bytes`` counts the tensor bytes handed over (per subscriber);
    ``dtype`` as ``WeightPublisher``'s (a cast tensor is a copy, so it is its snapshot)."""

    def __init__(self, addresses: list[str], *, snapshot: bool, dtype: torch.dtype | None = None) -> None:
        self.addresses, self.snapshot, self.dtype = addresses, snapshot, dtype
        self._slots = [_slot(a) for a in addresses]
        self._socks = []
        for a in addresses:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4)
            sock.connect(_inproc(a))
            self._socks.append(sock)
        self.version = -1
        self.published_bytes = 0

    def follow_engine(self, address: str, dtype: torch.dtype, *, fresh: bool) -> bool:
        """False, changing nothing: an in-memory handoff has no wire to save, and the engine
        casts as it copies (``WeightPublisher.follow_engine`` for the channel)."""
        return False

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Hand ``state_dict`` over as policy ``version``; returns 1 (one "bucket").

        Raises:
            ValueError: ``version`` is not greater than the last published one, or the state dict is empty.
            TypeError: a value is not a tensor (names the parameter).
        """
        if version <= self.version:
            raise ValueError(f"weight versions must increase: got {version} after {self.version}")
        check_publishable(state_dict)
        cast = cast_on_wire(state_dict, self.dtype)  # a cast copies; an uncast tensor is the trainer's own
        state = {n: t.detach().to(self.dtype) if n in cast else t.detach().clone() if self.snapshot else t.detach()
                 for n, t in state_dict.items()}
        for slot, sock in zip(self._slots, self._socks):
            with slot.lock:
                slot.overwritten += slot.latest is not None
                slot.latest = (version, state)
            try:
                sock.send(b"", zmq.NOBLOCK)  # a wake-up only: the slot holds the version
            except zmq.Again:
                pass  # wake-ups already queued: the subscriber will look at the slot
        self.published_bytes += sum(t.numel() * t.element_size() for t in state.values()) * len(self._slots)
        self.version = version
        return 1

    def close(self) -> None:
        for sock in self._socks:
            sock.close()


class InProcessSubscriber(VersionedSubscriber):
    """Engine side (module doc); the interface of ``runtime.weight_subscriber.WeightSubscriber`` that a
    replica uses (``poll``, ``wait``, ``version``, ``state_dict``, ``late_versions``,
    ``rejected``, ``dropped_versions``, ``close``; ``_sock`` for ``wait_any``)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._slot = _slot(address)
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(_inproc(address))
        self.version = -1
        self.state_dict: dict[str, torch.Tensor] | None = None
        self.expected: TensorSet | None = None
        self.dropped_versions = self.late_versions = self.rejected = self.set_errors = 0

    def poll(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest version newer than :attr:`version`, as ``(version, state dict)``, or None.

        Raises:
            TensorSetError: its tensor set differs from the first version's (names the
                differences); discarded, :attr:`state_dict` keeps the previous weights.
        """
        while True:
            try:
                self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        with self._slot.lock:
            latest, self._slot.latest = self._slot.latest, None
            self.dropped_versions += self._slot.overwritten
            self._slot.overwritten = 0
        if latest is None or latest[0] <= self.version:
            self.late_versions += latest is not None
            return None
        return self._accept(*latest)

    def close(self) -> None:
        self._sock.close()
        with _SLOTS_LOCK:
            _SLOTS.pop(self.address, None)
