"""Issue 26: objects between trainer ranks are MAC-checked before they are unpickled
(``runtime.parallel.signed_objects``), over two gloo ranks."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist

from runtime.parallel import signed_objects
from runtime.parallel.launch import spawn_workers


class _Marker:
    """Unpickling it creates the file ``path``: the proof that a message was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _raw_broadcast(message: bytes) -> None:
    """Rank 0 sends ``message`` as signed_objects.broadcast does (length, then bytes), unsigned."""
    dist.broadcast(torch.tensor([len(message)], dtype=torch.int64), src=0)
    dist.broadcast(torch.frombuffer(bytearray(message), dtype=torch.uint8), src=0)


def _exchange(rank: int, world_size: int, marker: str) -> dict:
    out = {}
    # genuine traffic: values by hand
    out["broadcast"] = signed_objects.broadcast({"step": 3} if rank == 0 else None, src=0, channel="rank_commands")
    out["gather"] = signed_objects.all_gather({"n_tokens": 10.0 * (rank + 1)}, "dp_metrics")
    if rank == 1:
        signed_objects.send({"w": torch.arange(3)}, 0, "weight_buckets")
    else:
        out["recv"] = signed_objects.recv(1, "weight_buckets")
    # 1. forged: a pickle that would create ``marker``, behind a MAC of another key
    payload = pickle.dumps(_Marker(marker))
    if rank == 0:
        _raw_broadcast(b"\x00" * 32 + payload)
    else:
        with pytest.raises(signed_objects.TamperedMessage) as info:
            signed_objects.broadcast(None, src=0, channel="rank_commands")
        out["forged"] = str(info.value)
        out["unpickled"] = os.path.exists(marker)
    # 2. cross-channel: a genuine message of dp_metrics sent as a rank command
    if rank == 0:
        _raw_broadcast(signed_objects.seal({"loss": 1.0}, "dp_metrics").numpy().tobytes())
    else:
        with pytest.raises(signed_objects.TamperedMessage, match="rank_commands: the message from rank 0"):
            signed_objects.broadcast(None, src=0, channel="rank_commands")
    # 3. one flipped payload bit of a genuine rank command
    if rank == 0:
        sealed = bytearray(signed_objects.seal({"step": 4}, "rank_commands").numpy().tobytes())
        sealed[-2] ^= 1
        _raw_broadcast(bytes(sealed))
    else:
        with pytest.raises(signed_objects.TamperedMessage):
            signed_objects.broadcast(None, src=0, channel="rank_commands")
    return out


def test_ranks_exchange_signed_objects_and_refuse_tampered_ones_before_unpickling(tmp_path):
    marker = str(tmp_path / "unpickled")
    rank0, rank1 = spawn_workers(_exchange, 2, (marker,), backend="gloo", timeout_s=60.0)
    assert rank0["broadcast"] == rank1["broadcast"] == {"step": 3}
    assert rank0["gather"] == rank1["gather"] == [{"n_tokens": 10.0}, {"n_tokens": 20.0}]
    assert rank0["recv"]["w"].tolist() == [0, 1, 2]
    assert rank1["forged"].startswith(f"rank_commands: the message from rank 0 failed its MAC ({32 + len(pickle.dumps(_Marker(marker)))} bytes): not unpickled")
    assert rank1["unpickled"] is False and not os.path.exists(marker)


def test_a_process_without_the_secret_cannot_seal(monkeypatch):
    monkeypatch.setattr(signed_objects, "_secret", None)
    with pytest.raises(RuntimeError, match="no secret in this process"):
        signed_objects.seal({}, "rank_commands")
    with pytest.raises(ValueError, match="channel secret must be bytes of length >= 16"):
        signed_objects.set_secret(b"short")
