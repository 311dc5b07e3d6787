"""The weight channel's receiving end: the generator takes whole, verified versions.

The wire format, the transport choice and what a version carries are ``runtime.weights``'
(the publishing end). Here a replica's :class:`WeightSubscriber` authenticates each bucket
(``runtime.channel_auth``), verifies its checksum, files it under its version, and returns
the newest version once every bucket of it has arrived; :class:`VersionedSubscriber` holds
what both subscribers share (``runtime.weights_in_process`` has the in-memory one): the
tensor-set check against the first version (``runtime.weight_set``) and :meth:`wait`.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import torch
import xxhash
import zmq

from runtime.channel_auth import Verifier
from runtime.channels import bind_socket, close_bound
from runtime.weight_set import TensorSet, TensorSetError, check_tensor_set, tensor_set

logger = logging.getLogger(__name__)


class WeightChecksumError(RuntimeError):
    """A received weight bucket's payload does not match its XXH3-64 checksum."""


def _dtype_from_name(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: unknown dtype {name!r}")
    return dtype


class VersionedSubscriber:
    """What every weight subscriber (this module's, ``runtime.weights_in_process``'s) does with a
    version once it has one whole: check its tensor set and hold it (:meth:`_accept`), and
    :meth:`wait` for one. A subclass gives ``poll()``, ``_sock`` (a ZeroMQ socket readable when
    something arrived), ``address``, ``version``, ``state_dict``, ``expected``, ``set_errors``."""

    def _accept(self, version: int, staged: dict[str, torch.Tensor]) -> tuple[int, dict[str, torch.Tensor]]:
        """Hold ``staged`` as ``version`` and return both; the first version held sets the tensor set.

        Raises:
            TensorSetError: ``staged``'s tensor set differs from the first version's (counted in
                ``set_errors``; discarded: :attr:`state_dict` keeps the previous weights).
        """
        if self.expected is not None:
            try:
                check_tensor_set(self.expected, staged, f"weight version {version} on {self.address}")
            except TensorSetError as err:
                self.set_errors += 1
                raise TensorSetError(f"{err}; version {version} discarded, keeping version {self.version}") from None
        self.expected = self.expected or tensor_set(staged)
        self.version, self.state_dict = version, staged
        return version, staged

    def wait(self, min_version: int, timeout_s: float | None = None) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Block until a version ``>= min_version`` is held; return the newest, or ``None`` on timeout.

        Args:
            timeout_s: seconds to wait (``None``: forever).

        Raises:
            WeightChecksumError, TensorSetError: as ``poll`` raises them.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.poll()
            if self.version >= min_version:
                return self.version, self.state_dict
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            self._sock.poll(100 if remaining is None else max(1, int(min(remaining, 0.1) * 1000)), zmq.POLLIN)


class WeightSubscriber(VersionedSubscriber):
    """Generator side of the weight channel (PULL, binds).

    Args:
        address: endpoint to bind; ``None`` binds a random loopback TCP port (see
            :attr:`address`).
        secret: the run's channel secret (``runtime.channel_auth``).
        high_water_mark: buckets queued on this side before the publisher is throttled.

    Attributes:
        version: newest version returned so far (``-1``: none yet).
        state_dict: its tensors (``None`` before the first); unchanged when a later
            version fails verification.
        dropped_versions: versions received (whole or in part) but superseded by a newer
            complete version before being returned.
        checksum_errors: buckets that failed verification.
        rejected: buckets dropped unread because their MAC did not verify or they were
            replayed (forged, captured and sent again, from
            another run, or corrupted in transit).
        late_versions: versions whose buckets arrived after a version at least as new was
            complete (e.g. a restarted replica's resync racing the next publication);
            dropped, counted, and logged once per version.
        received_bytes: payload bytes received.
        expected: the tensor set (``runtime.weight_set``: names, shapes, dtypes) every
            version must have: the first version returned sets it. set_errors: versions
            discarded because theirs differed.

    Raises:
        ValueError: the address cannot be bound.
    """

    def __init__(self, address: str | None = None, *, secret: bytes, high_water_mark: int = 16) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, high_water_mark)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address = bind_socket(self._sock, address)
        self._verifier = Verifier(secret, address if address is not None else self.address)
        self.version = -1
        self.state_dict: dict[str, torch.Tensor] | None = None
        self.dropped_versions = 0
        self.checksum_errors = 0
        self.late_versions = 0
        self.received_bytes = 0
        self.expected: TensorSet | None = None
        self.set_errors = 0
        self._late: set[int] = set()
        self._superseded: set[int] = set()  # counted in dropped_versions already
        self._partial: dict[int, dict[int, tuple[dict, zmq.Frame]]] = {}
        self._rejected: set[int] = set()
        self._ready: tuple[int, dict[int, tuple[dict, zmq.Frame]]] | None = None

    @property
    def rejected(self) -> int:
        """Buckets dropped unread: their MAC did not verify, or they replayed an earlier one."""
        return self._verifier.rejected

    def _receive_one(self, frames: list[zmq.Frame]) -> None:
        """Authenticate one bucket, verify it, and file it under its version; may complete a version."""
        frames = self._verifier.accept(frames, 2)
        if frames is None:
            return
        header = json.loads(frames[0].bytes)
        version, b, n = header["version"], header["bucket"], header["n_buckets"]
        newest_ready = self._ready[0] if self._ready else self.version
        if version in self._rejected:
            return  # rest of a rejected version
        if version <= newest_ready:
            if version not in self._late and version not in self._superseded:
                self._late.add(version)
                self.late_versions += 1
                logger.warning("weight channel %s: version %d arrived after version %d; dropped", self.address,
                               version, newest_ready)
            return
        payload = frames[1].buffer
        self.received_bytes += len(payload)
        if len(payload) != header["payload_bytes"] or xxhash.xxh3_64(payload).intdigest() != header["checksum"]:
            self.checksum_errors += 1
            self._rejected.add(version)
            self._partial.pop(version, None)
            raise WeightChecksumError(
                f"weight version {version}, bucket {b}/{n}: payload checksum mismatch "
                f"({len(payload)} bytes); parameters {header['names']}; version {version} "
                f"discarded, keeping version {self.version}"
            )
        parts = self._partial.setdefault(version, {})
        parts[b] = (header, frames[1])
        if len(parts) == n:
            del self._partial[version]
            older = [v for v in self._partial if v < version]
            self.dropped_versions += len(older) + (self._ready is not None)
            self._superseded.update(older)
            for v in older:
                del self._partial[v]
            self._ready = (version, parts)

    def _materialize(self, version: int, parts: dict[int, tuple[dict, zmq.Frame]]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for b in sorted(parts):
            header, frame = parts[b]
            buf = torch.empty(header["payload_bytes"], dtype=torch.uint8)
            buf.numpy()[:] = np.frombuffer(frame.buffer, dtype=np.uint8)
            for name, shape, dt, off, nb in zip(header["names"], header["shapes"], header["dtypes"],
                                                header["offsets"], header["nbytes"]):
                dtype = _dtype_from_name(dt, f"weight version {version} parameter {name!r}")
                out[name] = buf[off:off + nb].view(dtype).view(shape)
        for name, same in parts[min(parts)][0].get("aliases", {}).items():  # tied tensors, sent once
            if same in out:  # else the tensor set check names the missing one
                out[name] = out[same]
        return out

    def poll(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Drain what has arrived without blocking; return the newest new complete version.

        Returns ``(version, state_dict)`` — a whole, verified state dict of CPU tensors —
        when a version newer than :attr:`version` completed, else ``None``.

        Raises:
            WeightChecksumError: a bucket failed verification (names version, bucket index
                and parameter names); that version is discarded and :attr:`state_dict`
                keeps the previous weights. A later poll may still return a newer version.
            TensorSetError: the version's tensor set differs from :attr:`expected` (names
                the differences); discarded and counted in :attr:`set_errors`, as above.
        """
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._receive_one(frames)
        if self._ready is None:
            return None
        version, parts = self._ready
        self._ready = None
        return self._accept(version, self._materialize(version, parts))

    def close(self) -> None:
        """Close the socket without waiting and remove an ``ipc://`` socket file."""
        close_bound(self._sock, self.address)
