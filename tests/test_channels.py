"""Experience channel (cross-process, exactly-once) and weight channel (buckets, checksums)."""

from __future__ import annotations

import multiprocessing as mp
import random
import time

import pytest
import torch

from areal_flow.types import Trajectory
from runtime.channel_auth import new_secret
from runtime.channels import MessageReceiver, MessageSender, free_tcp_address, ipc_address
from runtime.weight_subscriber import WeightChecksumError, WeightSubscriber
from runtime.weights import WeightPublisher, split_buckets


KEY = b"k" * 32  # the run's channel secret in these tests


def _group(index: int, n: int = 2) -> list[Trajectory]:
    return [
        Trajectory(sample_id=f"{index}:{j}", group_id=index, prompt_ids=[1, 2], output_ids=[3, j],
                   behavior_logprobs=[-0.5, -1.0], versions=[index // 4, index // 4],
                   finish_reason="stop", reward=float(j))
        for j in range(n)
    ]


def _send_shuffled(address: str, n_groups: int, seed: int) -> None:
    order = list(range(n_groups))
    random.Random(seed).shuffle(order)
    sender = MessageSender(address, secret=KEY)
    for i in order:
        sender.send((i, _group(i)))
    sender.close()  # linger lets the queued groups reach the receiver before exit


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_experience_round_trip_across_processes_exactly_once(transport):
    receiver = MessageReceiver(None if transport == "tcp" else ipc_address("exp"), secret=KEY)
    n_groups = 40
    proc = mp.get_context("spawn").Process(target=_send_shuffled, args=(receiver.address, n_groups, 7))
    proc.start()
    got: dict[int, list[Trajectory]] = {}
    deadline = time.monotonic() + 30
    while len(got) < n_groups and time.monotonic() < deadline:
        item = receiver.recv(timeout_s=0.5)
        if item is not None:
            index, group = item
            assert index not in got, f"group {index} delivered twice"
            got[index] = group
    proc.join(10)
    assert proc.exitcode == 0
    assert receiver.recv(timeout_s=0.2) is None  # nothing beyond the 40 groups
    receiver.close()
    assert sorted(got) == list(range(n_groups))
    assert got[13] == _group(13)  # dataclass equality: every field survived the trip


def test_experience_sender_before_receiver_binds_loses_nothing():
    address = free_tcp_address()
    sender = MessageSender(address, secret=KEY)
    for i in range(3):
        sender.send((i, _group(i, n=1)))  # queued by PUSH; no peer yet
    receiver = MessageReceiver(address, secret=KEY)
    got = [receiver.recv(timeout_s=5) for _ in range(3)]
    assert [g[0] for g in got] == [0, 1, 2] and got[2][1] == _group(2, n=1)
    assert receiver.recv(timeout_s=0) is None and receiver.rejected == 0
    sender.close()
    receiver.close()


@pytest.fixture
def weight_pair():
    subs, pubs = [], []

    def make(**kw):
        sub = WeightSubscriber(ipc_address("w"), secret=KEY)
        pub = WeightPublisher(sub.address, secret=KEY, linger_s=0, **kw)
        subs.append(sub)
        pubs.append(pub)
        return pub, sub

    yield make
    for s in pubs + subs:
        s.close()


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(50, 8, generator=g),
        "layer.norm": torch.randn(8, generator=g).to(torch.bfloat16),
        "pos_ids": torch.arange(12, dtype=torch.int64).reshape(3, 4) + seed,
        "scale": torch.tensor(1.5 + seed),  # 0-dim
        "transposed": torch.randn(4, 6, generator=g).t(),  # non-contiguous
    }


def _assert_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


def test_weight_round_trip_fp32_bf16_int64(weight_pair):
    pub, sub = weight_pair()
    assert sub.poll() is None and sub.version == -1
    state = _state(0)
    assert pub.publish(state, version=1) == 1  # ~2 KB total: one 64 MiB bucket
    version, got = sub.wait(1, timeout_s=5)
    assert version == 1 and sub.version == 1
    _assert_equal(got, state)
    assert sub.poll() is None  # nothing new


def test_weight_matrices_travel_in_the_wire_dtype_vectors_and_the_lm_head_as_they_are(weight_pair):
    pub, sub = weight_pair(dtype=torch.bfloat16)
    state = {**_state(0), "lm_head.weight": torch.randn(50, 8)}
    pub.publish(state, version=1)
    _, got = sub.wait(1, timeout_s=5)
    for name in ("embed.weight", "transposed"):  # matrices: cast, rounded to nearest even as .to() rounds
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], state[name].to(torch.bfloat16)), name
    for name in ("scale", "lm_head.weight", "layer.norm", "pos_ids"):  # 0-/1-D, the output embedding, bf16, ints
        assert got[name].dtype == state[name].dtype and torch.equal(got[name], state[name]), name
    # bytes by hand, each tensor padded to 64: embed 50*8*2 = 800 -> 832; norm 8*2 = 16 -> 64; ids 12*8 = 96 -> 128;
    # scale 4 -> 64; transposed 24*2 = 48 -> 64; head 50*8*4 = 1600
    assert pub.published_bytes == 832 + 64 + 128 + 64 + 64 + 1600


def test_tied_tensors_travel_once_and_arrive_under_both_names(weight_pair):
    pub, sub = weight_pair(dtype=torch.bfloat16)
    embed = torch.randn(50, 8)
    state = {"model.embed_tokens.weight": embed, "layer": torch.randn(4, 4), "lm_head.weight": embed,
             "view": embed[:10]}  # a view of part of it is no tie
    pub.publish(state, version=1)
    _, got = sub.wait(1, timeout_s=5)
    assert list(got) == ["model.embed_tokens.weight", "layer", "view", "lm_head.weight"]
    assert got["lm_head.weight"] is got["model.embed_tokens.weight"] and torch.equal(got["lm_head.weight"], embed)
    assert got["view"].dtype == torch.bfloat16  # part of the head's storage is not the head: cast
    # embed fp32 once 1600 + layer bf16 32 -> 64 + view bf16 10*8*2 = 160 -> 192
    assert pub.published_bytes == 1600 + 64 + 192
    pub, sub = weight_pair(dtype=torch.bfloat16)
    copied = {"model.embed_tokens.weight": embed.clone(), "lm_head.weight": embed.clone()}  # a tie lost in a copy
    pub.publish(copied, version=1)
    _, got = sub.wait(1, timeout_s=5)
    assert got["lm_head.weight"] is got["model.embed_tokens.weight"] and got["lm_head.weight"].dtype == torch.float32
    assert pub.published_bytes == 1600  # sent once, in fp32


def test_each_subscriber_gets_the_dtype_its_engine_announced_from_its_first_version_on():
    """``weights_dtype: engine``: one publisher, two engines; bf16 matrices to the one that announced
    bf16, fp32 to the other; a late announcement to a subscriber that already holds versions is
    refused (its tensor set is fixed by its first version), a restarted (fresh) one's is taken."""
    subs = [WeightSubscriber(ipc_address(f"e{i}"), secret=KEY) for i in range(2)]
    pub = WeightPublisher([s.address for s in subs], secret=KEY, linger_s=0)
    try:
        layer, norm = torch.randn(16, 8), torch.randn(8)
        state = {"layer.weight": layer, "norm.weight": norm}
        assert pub.follow_engine(subs[0].address, torch.bfloat16, fresh=False)
        assert not pub.follow_engine("ipc:///nowhere", torch.bfloat16, fresh=False)  # not one of its subscribers
        pub.publish(state, version=1)
        got = [s.wait(1, timeout_s=5)[1] for s in subs]
        assert got[0]["layer.weight"].dtype == torch.bfloat16 and torch.equal(got[0]["layer.weight"],
                                                                             layer.to(torch.bfloat16))
        assert got[1]["layer.weight"].dtype == torch.float32 and torch.equal(got[1]["layer.weight"], layer)
        assert all(g["norm.weight"].dtype == torch.float32 for g in got)  # a vector travels as trained
        # by hand: layer 16*8*2 = 256 B + norm 8*4 = 32 -> 64; fp32 layer 512 + norm 64
        assert pub.published_bytes == (256 + 64) + (512 + 64)
        assert not pub.follow_engine(subs[1].address, torch.bfloat16, fresh=False)  # it holds fp32 versions
        assert pub.follow_engine(subs[0].address, torch.bfloat16, fresh=False)  # the same dtype again: kept
        pub.publish(state, version=2)
        assert subs[1].wait(2, timeout_s=5)[1]["layer.weight"].dtype == torch.float32
        assert pub.follow_engine(subs[1].address, torch.bfloat16, fresh=True)  # a restarted replica starts anew
        sent = pub.published_bytes
        pub.publish(state, version=3)
        assert pub.published_bytes - sent == 2 * (256 + 64)
    finally:
        for s in (pub, *subs):
            s.close()


def test_split_buckets_by_hand():
    state = {
        "a": torch.zeros(100),  # 400 B → 448 aligned to 64
        "b": torch.zeros(100),  # 448 + 448 = 896 <= 1024: same bucket
        "c": torch.zeros(1000),  # 4000 B > 1024: alone
        "d": torch.zeros(10, dtype=torch.int64),  # 80 B → 128
        "e": torch.zeros(16, dtype=torch.bfloat16),  # 32 B → 64; 128 + 64 = 192: joins d
    }
    assert split_buckets(state, 1024) == [["a", "b"], ["c"], ["d", "e"]]
    with pytest.raises(TypeError, match="'x'"):
        split_buckets({"x": [1.0]}, 1024)
    with pytest.raises(ValueError, match="empty"):
        split_buckets({}, 1024)


def test_weight_multi_bucket_round_trip(weight_pair):
    pub, sub = weight_pair(bucket_bytes=1024)
    state = _state(1)
    # embed 1600 B alone; norm 16→64 + pos 96→128 + scale 4→64 + transposed 96→128 = 384 B
    assert pub.publish(state, version=1) == 2
    version, got = sub.wait(1, timeout_s=5)
    _assert_equal(got, state)


def test_weight_newest_version_wins(weight_pair):
    pub, sub = weight_pair(bucket_bytes=1024)
    for v in (1, 2, 3):
        pub.publish(_state(v), version=v)
    time.sleep(0.5)  # let all 3 versions × 2 buckets (~4 KB over ipc) arrive
    version, got = sub.poll()
    assert version == 3 and sub.dropped_versions == 2
    _assert_equal(got, _state(3))
    assert sub.poll() is None
    with pytest.raises(ValueError, match="must increase"):
        pub.publish(_state(0), version=3)


def test_weight_older_version_arriving_late_is_dropped_and_counted(weight_pair):
    pub, sub = weight_pair(bucket_bytes=1024)
    pub.publish(_state(2), version=2)
    assert sub.wait(2, timeout_s=5)[0] == 2
    late = WeightPublisher(sub.address, secret=KEY, bucket_bytes=1024, linger_s=0)  # e.g. a resync racing the next version
    late.publish(_state(1), version=1)  # 2 buckets of an older version
    deadline = time.monotonic() + 5
    while sub.late_versions == 0 and time.monotonic() < deadline:
        assert sub.poll() is None
        time.sleep(0.01)
    assert sub.version == 2 and sub.late_versions == 1
    _assert_equal(sub.state_dict, _state(2))
    late.close()


def test_weight_corrupted_bucket_raises_and_keeps_previous(weight_pair):
    def flip_first_byte(header, payload):
        if header["version"] == 2 and header["bucket"] == 1:
            payload[0] ^= 0xFF

    pub, sub = weight_pair(bucket_bytes=1024, tamper=flip_first_byte)
    pub.publish(_state(1), version=1)
    sub.wait(1, timeout_s=5)
    pub.publish(_state(2), version=2)
    with pytest.raises(WeightChecksumError) as err:
        sub.wait(2, timeout_s=5)
    msg = str(err.value)
    assert "weight version 2, bucket 1/2" in msg and "'layer.norm'" in msg and "keeping version 1" in msg
    assert sub.version == 1 and sub.checksum_errors == 1
    _assert_equal(sub.state_dict, _state(1))
    # the channel recovers with the next good version
    pub.publish(_state(3), version=3)
    version, got = sub.wait(3, timeout_s=5)
    assert version == 3
    _assert_equal(got, _state(3))


def test_weight_wait_times_out(weight_pair):
    _, sub = weight_pair()
    t0 = time.monotonic()
    assert sub.wait(0, timeout_s=0.2) is None
    assert 0.15 < time.monotonic() - t0 < 2.0


# --- authentication: nothing is unpickled or loaded before its MAC verifies -------------------


class _Bomb:
    """Unpickling it would run code (here: set a flag); a forged message carries it."""

    ran = False

    def __reduce__(self):
        return (_Bomb._explode, ())

    @staticmethod
    def _explode():
        _Bomb.ran = True


def test_a_forged_message_is_rejected_unread_and_counted():
    import pickle

    import zmq

    from runtime.channels import MessageReceiver, MessageSender

    receiver = MessageReceiver(ipc_address("ctl"), secret=KEY)
    raw = zmq.Context.instance().socket(zmq.PUSH)  # an attacker: no secret, a pickle that runs code
    other_run = MessageSender(receiver.address, secret=new_secret(), linger_s=0)  # another run's secret
    genuine = MessageSender(receiver.address, secret=KEY, linger_s=0)
    try:
        raw.connect(receiver.address)
        raw.send_multipart([b"\0" * 32, pickle.dumps(_Bomb())])
        raw.send(pickle.dumps(_Bomb()))  # no MAC frame at all
        other_run.send(("sent", 0, 1, 1))
        genuine.send(("version", 0, 3))
        # the PULL end fair-queues its peers, so the genuine message may come before or after the others
        assert receiver.recv(timeout_s=5) == ("version", 0, 3)
        assert receiver.recv(timeout_s=0.5) is None  # drains (and drops) whatever is left
        assert receiver.rejected == 3 and not _Bomb.ran
    finally:
        raw.close(linger=0)
        for end in (other_run, genuine, receiver):
            end.close()


def test_a_forged_experience_message_is_rejected():
    import pickle

    import zmq

    receiver = MessageReceiver(ipc_address("exp"), secret=KEY)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    try:
        raw.connect(receiver.address)
        raw.send_multipart([b"\1" * 32, pickle.dumps((0, _group(0)))])  # well-formed, with a wrong MAC
        assert receiver.recv(timeout_s=1.0) is None and receiver.rejected == 1
    finally:
        raw.close(linger=0)
        receiver.close()


def test_a_forged_weight_bucket_is_dropped_before_loading(weight_pair):
    import json

    import zmq

    pub, sub = weight_pair()
    pub.publish(_state(1), version=1)
    assert sub.wait(1, timeout_s=5)[0] == 1
    forged = _state(9)  # version 2 with the attacker's weights, a valid checksum, no valid MAC
    good = WeightPublisher(ipc_address("unused"), secret=KEY, linger_s=0)
    frames = []
    good._socks[0].send_multipart = lambda f, copy=False: frames.extend(f)  # capture a genuine bucket's frames
    good.publish(forged, version=2)
    good.close()
    raw = zmq.Context.instance().socket(zmq.PUSH)
    try:
        raw.connect(sub.address)
        raw.send_multipart([b"\0" * 32, frames[1], frames[2], bytes(frames[3])])  # [mac, stamp, header, payload]
        deadline = time.monotonic() + 5
        while sub.rejected == 0 and time.monotonic() < deadline:
            assert sub.poll() is None
            time.sleep(0.01)
        assert sub.rejected == 1 and sub.version == 1 and json.loads(frames[2])["version"] == 2
        _assert_equal(sub.state_dict, _state(1))
    finally:
        raw.close(linger=0)


def test_a_missing_secret_is_refused_naming_the_channel():
    from runtime.channels import MessageSender

    with pytest.raises(ValueError, match=r"channel tcp://127.0.0.1:9: channel secret must be bytes of length >= 16"):
        MessageSender("tcp://127.0.0.1:9", secret=b"")


def test_ray_channels_bind_loopback_unless_an_interface_is_named():
    from runtime.ray_workers import bind_ip, free_tcp_endpoint

    assert bind_ip("") == "127.0.0.1" and bind_ip("10.1.2.3") == "10.1.2.3"
    assert free_tcp_endpoint("").startswith("tcp://127.0.0.1:")


def test_a_replica_announces_its_engine_dtype_on_its_experience_socket_ahead_of_its_first_trajectory():
    """``tell_trainer`` sends the dtype on the replica's own sender to the trainer's inbox when it has one, so
    the announcement cannot arrive after the first trajectory (a socket of its own raced the experience: the
    trainer then published version 1 in the wire dtype and refused the late announcement)."""
    from types import SimpleNamespace

    from runtime.workers import tell_trainer

    receiver = MessageReceiver(ipc_address("inbox"), secret=KEY)
    experience = MessageSender(receiver.address, secret=KEY, linger_s=0)
    node = SimpleNamespace(name="sync", attrs={"weights_dtype": "engine"})
    spec = SimpleNamespace(trainer=receiver.address, weights="ipc:///weights-0", resync="", secret=KEY,
                           plan=SimpleNamespace(nodes=[node]))
    gen = SimpleNamespace(engine=SimpleNamespace(dtype=torch.bfloat16))
    try:
        to = tell_trainer(spec, gen, "sync", {receiver.address: experience})
        assert to is experience  # the same socket, not one of its own
        experience.send(("first trajectory",))
        got = [receiver.recv(timeout_s=10.0), receiver.recv(timeout_s=10.0)]
        assert got == [("engine_dtype", "ipc:///weights-0", "bfloat16", False), ("first trajectory",)]
        other = tell_trainer(spec, gen, "sync", {})  # no experience sender to that inbox: one of its own
        assert other is not None and other is not experience
        other.close()
    finally:
        experience.close()
        receiver.close()
