"""The router's admission-wait spans (``runtime.router``, edge ``dataset->generate``).

k = 0, B = 2, six prompts, one replica that loads versions 0, 1, 2 in turn. By the capacity
rule ``(k + v + 1) B``: version 0 admits groups 0-1, then admission is blocked until version
1 arrives; version 1 admits 2-3, blocked until version 2; version 2 admits 4-5 and no prompt
is left, so nothing blocks. Hence two spans, closed at versions 1 and 2, each at least as
long as the test held the next version back.
"""

from __future__ import annotations

import threading
import time

from runtime.channels import MessageReceiver, MessageSender, ipc_address
from runtime.router import Router
from runtime.trace import TraceRecorder, read_spans

KEY = b"admission-test-secret"
HELD_S = 0.05  # how long the test holds each next version back


def test_one_admission_span_per_version_the_router_waited_for(tmp_path):
    replica, control = MessageReceiver(ipc_address("replica"), secret=KEY), ipc_address("control")
    trace = TraceRecorder(tmp_path, "driver")
    router = Router([{"q": i} for i in range(6)], iter(()), 0, 2, [replica.address], control, trace, secret=KEY)
    stop = threading.Event()
    thread = threading.Thread(target=router.run, args=(stop,))
    thread.start()
    to_router = MessageSender(control, secret=KEY)
    admitted = []
    try:
        for version in range(3):
            to_router.send(("ready" if version == 0 else "version", 0, version))
            admitted.append([index for index, _, _ in replica.recv(timeout_s=30.0)[1]])
            time.sleep(HELD_S)
    finally:
        stop.set()
        thread.join(timeout=30.0)
        to_router.close()
        replica.close()
    assert admitted == [[0, 1], [2, 3], [4, 5]]
    spans = [s for s in read_spans(tmp_path) if s["args"].get("wait") == "admission"]
    assert [(s["name"], s["proc"], s["args"]["version"]) for s in spans] == [
        ("dataset->generate", "edge dataset->generate", 1), ("dataset->generate", "edge dataset->generate", 2)]
    assert all(s["dur"] >= HELD_S * 1e6 * 0.8 for s in spans)  # 20 % slack for the clock's resolution
