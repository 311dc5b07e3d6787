"""The weight channel: versioned parameter buckets from the trainer to the generator.

The trainer publishes its state dict after each step as version ``v``; the generator
polls between decode steps and swaps in the newest complete, checksum-verified version
whose tensor set (names, shapes, dtypes) is the first version's (``runtime.weight_set``);
nothing of a version reaches the caller before all of it has arrived and been verified.
Policy versions travel only here (the experience channel carries groups only).

Wire format: a state dict is split into buckets of at most ``bucket_bytes`` bytes (a single
tensor larger than that travels alone). One bucket = one four-frame ZeroMQ message:

* frames 0 and 1, MAC and stamp (``runtime.channel_auth.Signer``): HMAC-SHA256 under the
  run's secret of the subscriber's address, the stamp (publisher id, bucket counter) and the
  SHA-256 of frames 2 and 3 (hashed once per bucket, one MAC per subscriber); a bucket whose
  MAC does not verify (forged, or captured on another subscriber's channel), or a replayed
  one, is dropped before its header is parsed, and counted (``rejected``);
* frame 2, JSON header: ``version``, ``bucket`` (index), ``n_buckets``, per tensor
  ``names`` / ``shapes`` / ``dtypes`` / ``offsets`` / ``nbytes`` (bytes into the payload),
  ``payload_bytes``, ``checksum`` (xxHash64 of the payload) and ``aliases`` (``{name: name
  sent}`` for tied tensors, which travel once: ``runtime.weight_wire.tied``);
* frame 3, payload: the raw tensor bytes, each tensor starting on a 64-byte boundary.

Tensors are copied once into the payload (a snapshot, so an optimizer step right after
:meth:`WeightPublisher.publish` cannot tear the message) and sent zero-copy; tensors are
never pickled.

Transport choice — PUSH/PULL, the subscriber binds, one PUSH socket per subscriber:
PUB/SUB silently drops whatever is published before a subscriber's subscription has
propagated (slow joiner) and whatever exceeds its high-water mark, which would lose buckets
and stall a generator waiting for a version. A connected PUSH queues until its peer is up
and applies back-pressure instead of dropping, so every bucket arrives, in order. PUSH
round-robins between peers, so fan-out to several generators uses one socket per
subscriber address (the payload is still built once). "Only the newest version matters" is
enforced on the receiving side, where superseded versions are dropped and counted.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import xxhash
import zmq

from runtime.channel_auth import Signer, Verifier
from runtime.weight_wire import cast_on_wire, head_names, tied
from runtime.channels import DEFAULT_LINGER_S, bind_socket, close_bound
from runtime.weight_set import TensorSet, TensorSetError, check_tensor_set, tensor_set

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
_ALIGN = 64  # bytes; keeps every tensor's offset divisible by its element size


class WeightChecksumError(RuntimeError):
    """A received weight bucket's payload does not match its xxHash64 checksum."""


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _dtype_from_name(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: unknown dtype {name!r}")
    return dtype


def check_publishable(state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raises ValueError for an empty state dict, TypeError for a value that is not a tensor
    (naming the parameter): what no weight channel can publish."""
    if not state_dict:
        raise ValueError("cannot publish an empty state dict")
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is {type(t).__name__}, not a torch.Tensor")


def split_buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Group parameter names, in state-dict order, into buckets of at most ``bucket_bytes`` bytes.

    Sizes count each tensor's bytes rounded up to 64 bytes; a tensor larger than
    ``bucket_bytes`` gets a bucket of its own.

    Raises:
        ValueError: ``bucket_bytes < 1`` or an empty state dict.
        TypeError: a value is not a tensor (names the parameter).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    check_publishable(state_dict)
    buckets: list[list[str]] = []
    size = 0
    for name, t in state_dict.items():
        n = _align(t.numel() * t.element_size())
        if not buckets or (buckets[-1] and size + n > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += n
    return buckets


def _pack(names: list[str], state_dict: Mapping[str, torch.Tensor], cast: frozenset[str] = frozenset(),
          dtype: torch.dtype | None = None) -> tuple[dict, torch.Tensor]:
    """Copy the named tensors (those in ``cast`` cast to ``dtype``: ``runtime.weight_wire.cast_on_wire``) into one
    uint8 payload; return (layout header, payload)."""
    tensors = [state_dict[n].detach().to("cpu", dtype if n in cast else None) for n in names]
    offsets, nbytes, total = [], [], 0
    for t in tensors:
        offsets.append(total)
        nbytes.append(t.numel() * t.element_size())
        total += _align(nbytes[-1])
    payload = torch.empty(total, dtype=torch.uint8)
    for t, off, nb in zip(tensors, offsets, nbytes):
        if nb:
            payload[off:off + nb].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    header = {
        "names": names,
        "shapes": [list(t.shape) for t in tensors],
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
        "offsets": offsets,
        "nbytes": nbytes,
        "payload_bytes": total,
    }
    return header, payload


class WeightPublisher:
    """Trainer side of the weight channel (PUSH; connects to each subscriber's address).

    Args:
        address: one subscriber endpoint, or a list for fan-out (every subscriber gets
            every bucket).
        secret: the run's channel secret (``runtime.channel_auth``).
        bucket_bytes: largest bucket payload, bytes (default 64 MiB).
        high_water_mark: buckets queued per subscriber before :meth:`publish` blocks.
        send_timeout_s: seconds :meth:`publish` waits on a full queue before failing.
        linger_s: seconds :meth:`close` waits to deliver queued buckets.
        tamper: test-only fault injection, ``tamper(header, payload_uint8_ndarray)`` runs
            after the checksum is computed and may mutate the payload in place.
        dtype: the wire dtype of the weight matrices (``runtime.weight_wire``; ``None``: each
            tensor's own). A 16-bit engine holds its layers in its dtype, so sending them in it
            halves their bytes to pack, hash, sign and receive at no loss (the plan's
            ``weights_dtype``, ``compiler.program``).
    """

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        secret: bytes,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        high_water_mark: int = 16,
        send_timeout_s: float = 60.0,
        linger_s: float = DEFAULT_LINGER_S,
        tamper: Callable[[dict, np.ndarray], None] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.addresses = [address] if isinstance(address, str) else list(address)
        self._signer = Signer(secret, f"weight channel {self.addresses}")
        self.bucket_bytes = bucket_bytes
        self.send_timeout_s = send_timeout_s
        self._tamper = tamper
        self.dtype = dtype
        self._ctx = zmq.Context()  # own context: close() terminates it to flush the queues
        self._socks = []
        for addr in self.addresses:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, high_water_mark)
            sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
            sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
            sock.connect(addr)
            self._socks.append(sock)
        self.version = -1
        self.published_bytes = 0

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Send ``state_dict`` as policy ``version``; return the number of buckets.

        Raises:
            ValueError: ``version`` is not greater than the last published one, or the
                state dict is empty.
            TypeError: a value is not a tensor.
            TimeoutError: a subscriber's queue stayed full for ``send_timeout_s`` seconds.
        """
        if version <= self.version:
            raise ValueError(f"weight versions must increase: got {version} after {self.version}")
        check_publishable(state_dict)
        heads = head_names(state_dict)
        aliases = tied(state_dict, heads)
        cast = cast_on_wire(state_dict, self.dtype, heads)
        sizes = {n: torch.empty(t.shape, dtype=self.dtype, device="meta") if n in cast else t  # buckets by wire bytes
                 for n, t in state_dict.items() if n not in aliases}
        buckets = split_buckets(sizes, self.bucket_bytes)
        for b, names in enumerate(buckets):
            header, payload = _pack(names, state_dict, cast, self.dtype)
            data = payload.numpy()
            header.update(version=version, bucket=b, n_buckets=len(buckets), aliases=aliases,
                          checksum=xxhash.xxh64(data).intdigest())
            if self._tamper is not None:
                self._tamper(header, data)
            frame0 = json.dumps(header).encode()
            signed = self._signer.frames_for(self.addresses, frame0, data)
            for addr, sock, frames in zip(self.addresses, self._socks, signed):
                try:
                    sock.send_multipart(frames, copy=False)
                except zmq.Again as e:
                    raise TimeoutError(
                        f"weight channel {addr}: bucket {b}/{len(buckets)} of version {version} "
                        f"not accepted within {self.send_timeout_s} s (subscriber not polling?)"
                    ) from e
            self.published_bytes += header["payload_bytes"] * len(self._socks)
        self.version = version
        return len(buckets)

    def close(self) -> None:
        """Deliver queued buckets, waiting at most ``linger_s`` seconds, then release the sockets.

        Call it before the process exits: queued buckets die with an unterminated context.
        """
        for sock in self._socks:
            sock.close()
        self._ctx.term()


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
        if len(payload) != header["payload_bytes"] or xxhash.xxh64(payload).intdigest() != header["checksum"]:
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
