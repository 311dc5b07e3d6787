"""Replay protection on authenticated channels (``runtime.channel_auth``): a captured,
correctly MACed message sent again is dropped unread and counted, on a message channel and
on the weight channel; a restarted sender (a new id) is not mistaken for a replay.
"""

from __future__ import annotations

import pickle
import time

import zmq

from runtime.channel_auth import Signer, Verifier
from runtime.channels import MessageReceiver, MessageSender, ipc_address
from runtime.weight_subscriber import WeightSubscriber
from runtime.weights import WeightPublisher
from test_channels import _Bomb  # unpickling it sets a flag: a replayed message must not be unpickled

KEY = b"k" * 32


def _capture(sock) -> list:
    """Record the frames ``sock`` sends (then send them as usual)."""
    captured, send = [], sock.send_multipart

    def record(frames, *args, **kw):
        captured.append([bytes(f) for f in frames])
        return send(frames, *args, **kw)

    sock.send_multipart = record
    return captured


def test_the_verifier_accepts_each_counter_once_per_sender():
    signer, verifier = Signer(KEY, "t"), Verifier(KEY, "t")
    first, second = signer.frames("t", b"a"), signer.frames("t", b"b")
    assert verifier.accept(second, 1) == [b"b"]  # counter 2
    assert verifier.accept(first, 1) is None  # counter 1 <= 2: a replay (one sender's messages arrive in order)
    assert verifier.accept(second, 1) is None
    assert verifier.accept(Signer(KEY, "t").frames("t", b"c"), 1) == [b"c"]  # a restarted sender: a new id, counter 1
    assert (verifier.rejected, verifier.replayed) == (2, 2)
    assert verifier.accept([first[0], first[1], b"x"], 1) is None  # a genuine stamp on other bytes: bad MAC
    assert (verifier.rejected, verifier.replayed) == (3, 2)


def test_a_replayed_message_is_rejected_unread_and_counted():
    receiver = MessageReceiver(ipc_address("ctl"), secret=KEY)
    sender = MessageSender(receiver.address, secret=KEY, linger_s=0)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    try:
        captured = _capture(sender._sock)
        sender.send(("version", 0, 3))
        sender.send(_Bomb())  # a genuine message whose replay, if unpickled, would show
        assert receiver.recv(timeout_s=5) == ("version", 0, 3)
        receiver.recv(timeout_s=5)  # the genuine one is unpickled once (its value is _explode()'s None)
        assert _Bomb.ran
        _Bomb.ran = False
        raw.connect(receiver.address)
        for frames in captured:  # an eavesdropper sends both again, MACs intact
            raw.send_multipart(frames)
        assert receiver.recv(timeout_s=1.0) is None
        assert receiver.rejected == 2 and receiver._verifier.replayed == 2 and not _Bomb.ran
        sender.send(("version", 0, 4))  # the sender's next message still gets through
        assert receiver.recv(timeout_s=5) == ("version", 0, 4)
    finally:
        raw.close(linger=0)
        sender.close()
        receiver.close()


def test_a_replayed_weight_bucket_is_dropped_before_its_header_is_read():
    sub = WeightSubscriber(ipc_address("w"), secret=KEY)
    pub = WeightPublisher(sub.address, secret=KEY, linger_s=0)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    try:
        import torch

        captured = _capture(pub._socks[0])
        pub.publish({"w": torch.ones(3)}, version=1)
        assert sub.wait(1, timeout_s=5)[0] == 1
        raw.connect(sub.address)
        raw.send_multipart(captured[0])  # version 1 again: without the counter it would count as a late version
        deadline = time.monotonic() + 5
        while sub.rejected == 0 and time.monotonic() < deadline:
            assert sub.poll() is None
            time.sleep(0.01)
        assert sub.rejected == 1 and sub.late_versions == 0 and sub.version == 1
    finally:
        raw.close(linger=0)
        pub.close()
        sub.close()


def test_stamps_are_inside_the_mac():
    signer, verifier = Signer(KEY, "t"), Verifier(KEY, "t")
    mac, stamp, payload = signer.frames("t", pickle.dumps(1))
    forged = stamp[:-8] + (99).to_bytes(8, "little")  # a replay with its counter raised
    assert verifier.accept([mac, forged, payload], 1) is None and verifier.replayed == 0 and verifier.rejected == 1


def test_a_message_signed_for_one_channel_is_rejected_on_another():
    """Issue 26: replay protection was per receiver only; a genuine message captured on one
    channel and sent to another (same run, same secret) was accepted there."""
    signer = Signer(KEY, "router")
    to_a = signer.frames("ipc:///run/replica-0", b"group 7")
    replica_a, replica_b = Verifier(KEY, "ipc:///run/replica-0"), Verifier(KEY, "ipc:///run/replica-1")
    assert replica_b.accept(to_a, 1) is None and (replica_b.rejected, replica_b.replayed) == (1, 0)
    assert replica_a.accept(to_a, 1) == [b"group 7"]


def test_one_bucket_signed_for_several_subscribers_verifies_only_on_its_own():
    signer = Signer(KEY, "publisher")
    channels = ["tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"]
    first, second = signer.frames_for(channels, b"header", b"payload")
    assert first[1] == second[1] and first[2:] == second[2:] == [b"header", b"payload"]  # one stamp, same frames
    assert first[0] != second[0]  # a MAC per channel
    assert Verifier(KEY, channels[1]).accept(second, 2) == [b"header", b"payload"]
    assert Verifier(KEY, channels[1]).accept(first, 2) is None
