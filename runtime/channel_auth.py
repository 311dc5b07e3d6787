"""Authenticated channel messages: an HMAC-SHA256 over every frame, with a per-run secret.

Owns the run's secret and the rule that nothing a channel receives is used — least of all
unpickled (a pickle from an unauthenticated peer is code execution) — before its MAC is
verified. The driver draws the secret (:func:`new_secret`, 32 random bytes) and hands it to
every worker in its spec (``runtime.workers.WorkerSpec.secret``, through the process
pipe or Ray's object store, never through the plan or a file). Every message is sent as
``[mac, stamp, frame, ...]`` (:class:`Signer`): ``stamp`` is the sending end's random
16-byte id and its message counter (8 bytes little-endian, from 1), and
``mac = HMAC-SHA256(secret, len(stamp) || stamp || len(frame) || frame || ...)`` (each length
as 8 little-endian bytes, so frame boundaries are authenticated too). A receiver
(:class:`Verifier`) drops a message whose MAC does not verify, and a replay: a message
whose counter is not above the last one it accepted from that sender id (a captured
genuine message sent again; ZeroMQ delivers one sender's messages in order, and a
restarted sender draws a new id). Both are counted (``rejected``; replays also in
``replayed``) and the first of each logged.

Not covered: confidentiality (frames travel in clear). Channels bind to loopback unless
``scheduler.bind_host`` names an interface.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets

MAC_BYTES = 32
SECRET_BYTES = 32
SENDER_BYTES = 16
STAMP_BYTES = SENDER_BYTES + 8  # sender id + message counter

logger = logging.getLogger(__name__)


def new_secret() -> bytes:
    """A fresh per-run secret (``SECRET_BYTES`` random bytes from ``secrets``)."""
    return secrets.token_bytes(SECRET_BYTES)


def check_secret(secret: bytes, where: str) -> bytes:
    """``secret`` when it is bytes of at least 16; else ValueError naming ``where``."""
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ValueError(f"{where}: channel secret must be bytes of length >= 16 (runtime.channel_auth.new_secret), "
                         f"got {type(secret).__name__}")
    return secret


def sign(secret: bytes, *frames) -> bytes:
    """HMAC-SHA256 of ``frames`` (bytes-like, each length-prefixed): ``MAC_BYTES`` bytes."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for frame in frames:
        view = memoryview(frame)
        mac.update(view.nbytes.to_bytes(8, "little"))
        mac.update(view)
    return mac.digest()


class Signer:
    """One sending end: stamps each message with its sender id and counter and signs it.

    Args:
        secret: the run's secret. where: names the channel in errors.

    Attributes:
        sender: this end's random id (``SENDER_BYTES``). sent: messages signed so far.

    Raises:
        ValueError: a malformed secret (:func:`check_secret`).
    """

    def __init__(self, secret: bytes, where: str) -> None:
        self.secret = check_secret(secret, where)
        self.sender = secrets.token_bytes(SENDER_BYTES)
        self.sent = 0

    def frames(self, *frames) -> list:
        """``[mac, stamp, *frames]``, ready to send as one multipart message."""
        self.sent += 1
        stamp = self.sender + self.sent.to_bytes(8, "little")
        return [sign(self.secret, stamp, *frames), stamp, *frames]


class Verifier:
    """Checks the MAC and the sender's counter of received messages for one channel end.

    Args:
        secret: the run's secret. where: names the channel in the log (its address).

    Attributes:
        rejected: messages dropped: a wrong MAC or frame count, or a replay.
        replayed: of those, replays (a genuine message whose counter was already passed).
    """

    def __init__(self, secret: bytes, where: str) -> None:
        self.secret, self.where = check_secret(secret, where), where
        self.rejected = 0
        self.replayed = 0
        self._last: dict[bytes, int] = {}  # sender id -> counter of its last accepted message

    def accept(self, frames: list, n_payload: int) -> list | None:
        """The payload frames when ``frames`` is ``[mac, stamp, *n_payload frames]`` with a
        valid MAC and a counter above the sender's last; otherwise None (the message is
        counted, the first of its kind logged)."""
        if len(frames) == n_payload + 2:
            mac, stamp = memoryview(frames[0]).tobytes(), memoryview(frames[1]).tobytes()
            if len(mac) == MAC_BYTES and len(stamp) == STAMP_BYTES and \
                    hmac.compare_digest(mac, sign(self.secret, *frames[1:])):
                sender, count = stamp[:SENDER_BYTES], int.from_bytes(stamp[SENDER_BYTES:], "little")
                if count > self._last.get(sender, 0):
                    self._last[sender] = count
                    return frames[2:]
                self.replayed += 1
                self.rejected += 1
                if self.replayed == 1:
                    logger.warning("channel %s: dropped a replayed message (sender %s, counter %d, already at %d); "
                                   "later ones are only counted", self.where, sender.hex(), count, self._last[sender])
                return None
        self.rejected += 1
        if self.rejected - self.replayed == 1:
            logger.warning("channel %s: dropped a message that failed authentication (%d frames; forged, from "
                           "another run, or corrupted); later ones are only counted", self.where, len(frames))
        return None
