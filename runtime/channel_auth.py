"""Authenticated channel messages: an HMAC-SHA256 over every frame, with a per-run secret.

Owns the run's secret and the rule that nothing a channel receives is used — least of all
unpickled (a pickle from an unauthenticated peer is code execution) — before its MAC is
verified. The driver draws the secret (:func:`new_secret`, 32 random bytes) and hands it to
every worker in its spec (``runtime.workers.WorkerSpec.secret``, through the process
pipe or Ray's object store, never through the plan or a file). Every message is sent as
``[mac, frame, ...]`` with ``mac = HMAC-SHA256(secret, len(frame) || frame || ...)`` (each
length as 8 little-endian bytes, so frame boundaries are authenticated too); a receiver
drops a message whose MAC does not verify, counts it and logs the first
(:class:`Verifier`).

Not covered: replay of a recorded genuine message by a peer on the same network (messages
carry no sequence number), and confidentiality (frames travel in clear). Channels bind to
loopback unless ``scheduler.bind_host`` names an interface.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets

MAC_BYTES = 32
SECRET_BYTES = 32

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


class Verifier:
    """Checks the MAC of received messages for one channel end.

    Args:
        secret: the run's secret. where: names the channel in the log (its address).

    Attributes:
        rejected: messages dropped because their MAC (or frame count) was wrong.
    """

    def __init__(self, secret: bytes, where: str) -> None:
        self.secret, self.where = check_secret(secret, where), where
        self.rejected = 0

    def accept(self, frames: list, n_frames: int) -> bool:
        """True when ``frames`` is ``[mac, *n_frames - 1 frames]`` with a valid MAC; otherwise
        the message is counted, the first one logged, and False returned."""
        if len(frames) == n_frames:
            mac = memoryview(frames[0]).tobytes()
            if len(mac) == MAC_BYTES and hmac.compare_digest(mac, sign(self.secret, *frames[1:])):
                return True
        self.rejected += 1
        if self.rejected == 1:
            logger.warning("channel %s: dropped a message that failed authentication (%d frames; forged, from "
                           "another run, or corrupted); later ones are only counted", self.where, len(frames))
        return False
