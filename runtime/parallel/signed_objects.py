"""Python objects between the ranks of one trainer, signed: nothing a rank receives over
``torch.distributed`` is unpickled before its MAC verifies.

``torch.distributed``'s object collectives (``broadcast_object_list``, ``all_gather_object``,
``send_object_list``) unpickle whatever arrives, and anyone who reaches the rendezvous
store or a gloo/NCCL port could send a pickle, which is code execution. Here an object is
pickled (``pickle``, as the object collectives do), then signed:

    mac = HMAC-SHA256(secret, len(channel) || channel || payload)

with the run's channel secret (``runtime.channel_auth``; each length 8 bytes little-endian;
``channel`` names the collective, so a message of one cannot pass as another's), and sent
as raw ``uint8`` tensors (its length first, then ``mac || payload``), which the collectives
copy without unpickling. A receiver checks the MAC (constant time) before unpickling and
raises :class:`TamperedMessage` naming the rank it came from on a mismatch.

The secret reaches each rank as an argument of its process start
(``runtime.parallel.launch.spawn_workers``, a process pipe), never through the store;
:func:`set_secret` keeps it for the process. Not covered: confidentiality, replay of a
message to the same collective (ranks exchange in lock step; a replayed frame desynchronises
the collective and times out).
"""

from __future__ import annotations

import hashlib
import hmac
import pickle

import torch
import torch.distributed as dist

from runtime.channel_auth import MAC_BYTES, check_secret

_secret: bytes | None = None


class TamperedMessage(RuntimeError):
    """A message between ranks failed its MAC: sent by no rank of this run (or altered)."""


def set_secret(secret: bytes) -> None:
    """Keep ``secret`` (bytes, >= 16) as this process's key for every signed collective.

    Raises:
        ValueError: ``secret`` is not bytes of length >= 16.
    """
    global _secret
    _secret = check_secret(secret, "runtime.parallel.signed_objects")


def _mac(channel: str, payload: bytes) -> bytes:
    if _secret is None:
        raise RuntimeError("runtime.parallel.signed_objects: no secret in this process (set_secret, done by "
                           "runtime.parallel.launch.spawn_workers)")
    name = channel.encode()
    h = hmac.new(_secret, len(name).to_bytes(8, "little") + name, hashlib.sha256)
    h.update(payload)
    return h.digest()


def seal(obj: object, channel: str) -> torch.Tensor:
    """``obj`` pickled and signed for ``channel``: a CPU ``uint8`` tensor ``mac || payload``."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(_mac(channel, payload) + payload), dtype=torch.uint8)


def open_sealed(message: torch.Tensor, channel: str, sender: int) -> object:
    """The object in ``message`` (from :func:`seal`) once its MAC verifies.

    Raises:
        TamperedMessage: the MAC does not verify (naming ``sender``, a global rank); nothing
            of the message was unpickled.
    """
    data = message.cpu().numpy().tobytes()
    mac, payload = data[:MAC_BYTES], data[MAC_BYTES:]
    if len(data) < MAC_BYTES or not hmac.compare_digest(mac, _mac(channel, payload)):
        raise TamperedMessage(f"{channel}: the message from rank {sender} failed its MAC ({len(data)} bytes): "
                              "not unpickled; a peer outside this run reached the trainer's ports, or the secret differs")
    return pickle.loads(payload)


def _device(group) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def broadcast(obj: object, src: int, channel: str, group=None) -> object:
    """``obj`` of global rank ``src`` on every rank of ``group`` (others pass anything).

    Raises:
        TamperedMessage: as :func:`open_sealed`.
    """
    device = _device(group)
    mine = dist.get_rank() == src
    message = seal(obj, channel).to(device) if mine else None
    size = torch.tensor([message.numel() if mine else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if not mine:
        message = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(message, src=src, group=group)
    return obj if mine else open_sealed(message, channel, src)


def all_gather(obj: object, channel: str, group=None) -> list[object]:
    """Every rank's ``obj``, in ``group``'s rank order.

    Raises:
        TamperedMessage: as :func:`open_sealed`.
    """
    device = _device(group)
    message = seal(obj, channel).to(device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([message.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:message.numel()] = message
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    me = dist.get_rank(group)
    return [obj if i == me else open_sealed(gathered[i][:int(sizes[i].item())], channel,
                                            dist.get_global_rank(group, i) if group is not None else i)
            for i in range(world)]


def send(obj: object, dst: int, channel: str) -> None:
    """Send ``obj`` to global rank ``dst`` (which calls :func:`recv`)."""
    device = _device(None)
    message = seal(obj, channel).to(device)
    dist.send(torch.tensor([message.numel()], dtype=torch.int64, device=device), dst=dst)
    dist.send(message, dst=dst)


def recv(src: int, channel: str) -> object:
    """The object global rank ``src`` sent with :func:`send`.

    Raises:
        TamperedMessage: as :func:`open_sealed`.
    """
    device = _device(None)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src=src)
    message = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(message, src=src)
    return open_sealed(message, channel, src)
