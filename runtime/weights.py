"""The weight channel: versioned parameter buckets from the trainer to the generator.

The trainer publishes its state dict after each step as version ``v`` (:class:`WeightPublisher`,
here); the generator polls between decode steps and swaps in the newest complete,
checksum-verified version whose tensor set (names, shapes, dtypes) is the first version's
(``runtime.weight_subscriber``, ``runtime.weight_set``); nothing of a version reaches the
caller before all of it has arrived and been verified. Policy versions travel only here
(the experience channel carries groups only).

Wire format: a state dict is split into buckets of at most ``bucket_bytes`` bytes (a single
tensor larger than that travels alone). One bucket = one four-frame ZeroMQ message:

* frames 0 and 1, MAC and stamp (``runtime.channel_auth.Signer``): HMAC-SHA256 under the
  run's secret of the subscriber's address, the stamp (publisher id, bucket counter) and the
  BLAKE3 digest of frames 2 and 3 (hashed once per bucket, one MAC per subscriber); a bucket whose
  MAC does not verify (forged, or captured on another subscriber's channel), or a replayed
  one, is dropped before its header is parsed, and counted (``rejected``);
* frame 2, JSON header: ``version``, ``bucket`` (index), ``n_buckets``, per tensor
  ``names`` / ``shapes`` / ``dtypes`` / ``offsets`` / ``nbytes`` (bytes into the payload),
  ``payload_bytes``, ``checksum`` (XXH3-64 of the payload) and ``aliases`` (``{name: name
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
subscriber address (the payload is still built once, or once per wire dtype where subscribers'
engines announced different ones: :meth:`WeightPublisher.follow_engine`). "Only the newest version matters" is
enforced on the receiving side, where superseded versions are dropped and counted.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import xxhash
import zmq

from runtime.channel_auth import Signer
from runtime.weight_wire import cast_on_wire, head_names, tied
from runtime.channels import DEFAULT_LINGER_S

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
_ALIGN = 64  # bytes; keeps every tensor's offset divisible by its element size


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


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
    uint8 payload, each in one ``copy_`` that casts and moves it off its device on the way; return (layout header,
    payload)."""
    tensors = [state_dict[n].detach() for n in names]
    dtypes = [dtype if n in cast else t.dtype for n, t in zip(names, tensors)]
    offsets, nbytes, total = [], [], 0
    for t, d in zip(tensors, dtypes):
        offsets.append(total)
        nbytes.append(t.numel() * d.itemsize)
        total += _align(nbytes[-1])
    payload = torch.empty(total, dtype=torch.uint8)
    for t, d, off, nb in zip(tensors, dtypes, offsets, nbytes):
        if nb:  # offsets are 64-byte aligned, so the slice views as any dtype
            payload[off:off + nb].view(d).view(t.shape).copy_(t)
    header = {
        "names": names,
        "shapes": [list(t.shape) for t in tensors],
        "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
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
            ``weights_dtype``, ``compiler.program``); a subscriber's own once its engine has
            announced it (:meth:`follow_engine`).
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
        self._dtypes = dict.fromkeys(self.addresses, dtype)  # each subscriber's wire dtype
        self._sent: set[str] = set()  # subscribers that have had a version

    def follow_engine(self, address: str, dtype: torch.dtype, *, fresh: bool) -> bool:
        """Send the subscriber at ``address`` its weight matrices in ``dtype``, the dtype its engine
        announced (a plan's ``weights_dtype: engine``), from the next version on. Returns False,
        changing nothing, when ``address`` is not one of this publisher's, or when it has had a
        version in another dtype and ``fresh`` is false: its subscriber checks every version's
        tensor set against its first (``runtime.weight_set``); a restarted replica (``fresh``)
        starts a new one."""
        if address not in self._dtypes or (address in self._sent and not fresh and self._dtypes[address] != dtype):
            return False
        self._dtypes[address] = dtype
        return True

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Send ``state_dict`` as policy ``version``; return the number of buckets (of the
        subscribers' largest wire dtype, where they differ).

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
        socks = dict(zip(self.addresses, self._socks))
        n_buckets = 0
        for dtype in dict.fromkeys(self._dtypes.values()):  # each wire dtype packed once, in address order
            addresses = [a for a, d in self._dtypes.items() if d == dtype]
            n_buckets = max(n_buckets, self._send(state_dict, version, dtype, heads, aliases,
                                                  [(a, socks[a]) for a in addresses]))
            self._sent.update(addresses)
        self.version = version
        return n_buckets

    def _send(self, state_dict: Mapping[str, torch.Tensor], version: int, dtype: torch.dtype | None,
              heads: frozenset[str], aliases: dict[str, str], targets: list[tuple[str, zmq.Socket]]) -> int:
        """Pack ``state_dict`` with its matrices in ``dtype`` and send every bucket to each of ``targets``
        (address, socket); the number of buckets."""
        cast = cast_on_wire(state_dict, dtype, heads)
        sizes = {n: torch.empty(t.shape, dtype=dtype, device="meta") if n in cast else t  # buckets by wire bytes
                 for n, t in state_dict.items() if n not in aliases}
        buckets = split_buckets(sizes, self.bucket_bytes)
        for b, names in enumerate(buckets):
            header, payload = _pack(names, state_dict, cast, dtype)
            data = payload.numpy()
            header.update(version=version, bucket=b, n_buckets=len(buckets), aliases=aliases,
                          checksum=xxhash.xxh3_64(data).intdigest())
            if self._tamper is not None:
                self._tamper(header, data)
            frame0 = json.dumps(header).encode()
            signed = self._signer.frames_for([a for a, _ in targets], frame0, data)
            for (addr, sock), frames in zip(targets, signed):
                try:
                    sock.send_multipart(frames, copy=False)
                except zmq.Again as e:
                    raise TimeoutError(
                        f"weight channel {addr}: bucket {b}/{len(buckets)} of version {version} "
                        f"not accepted within {self.send_timeout_s} s (subscriber not polling?)"
                    ) from e
            self.published_bytes += header["payload_bytes"] * len(targets)
        return len(buckets)

    def close(self) -> None:
        """Deliver queued buckets, waiting at most ``linger_s`` seconds, then release the sockets.

        Call it before the process exits: queued buckets die with an unterminated context.
        """
        for sock in self._socks:
            sock.close()
        self._ctx.term()
