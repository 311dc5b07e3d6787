"""The driver keeps nothing per step (issue 13, soak): the run logger and the router hold
running aggregates and the groups in flight only, so a long run's driver memory is flat.

Measured with ``tracemalloc`` (Python allocations of this process, every file) between a
warm-up and many more steps. What a per-step record would cost, by hand: the logger's
``history`` of before kept one dict of a step's scalars (a dict of 8 entries is ~360 bytes
on CPython 3.11, plus 24 bytes a float) -> over 300 bytes a step; the router's set of
completed indices kept an int (28 bytes) and a set slot (>= 16 bytes) per group -> over 40
bytes a group. The bounds below allow a tenth of that, for allocator and writer noise.
"""

from __future__ import annotations

import tracemalloc

from runtime.channels import MessageReceiver, ipc_address
from runtime.metrics import RunLogger
from runtime.router import Router

KEY = b"driver-memory-test-secret"
WARM, MORE = 50, 1000  # steps (groups) before the first snapshot, and between the two


def _growth(run_from: int, run_to: int, act) -> int:
    """Bytes still allocated after ``act(i)`` for ``i`` in ``[run_from, run_to)``, after a warm-up."""
    for i in range(WARM):
        act(i)
    tracemalloc.start()
    try:
        first = tracemalloc.take_snapshot()
        for i in range(run_from, run_to):
            act(i)
        last = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    return sum(d.size_diff for d in last.filter_traces(ignore).compare_to(first.filter_traces(ignore), "filename"))


def test_the_run_logger_keeps_no_per_step_record(tmp_path):
    logger = RunLogger(tmp_path, total_steps=WARM + MORE, show_progress=False)

    def step(i: int) -> None:
        logger.log_step({"step": i, "samples": 8, "staleness": [0, 1], "reward": 0.5 + i * 1e-6, "accuracy": 0.25,
                         "staleness_mean": 0.5, "loss": 0.1 * i, "grad_norm": 1.0 + i})

    grown = _growth(WARM, WARM + MORE, step)
    logger.close()
    assert grown < 30 * MORE, f"{grown} bytes over {MORE} steps"  # a tenth of ~300 bytes a step
    assert logger.samples == 8 * (WARM + MORE) and logger.staleness == {0: WARM + MORE, 1: WARM + MORE}


def test_the_router_keeps_no_record_of_completed_groups(tmp_path):
    replica, n = MessageReceiver(ipc_address("replica"), secret=KEY), WARM + MORE
    router = Router([{"q": i} for i in range(n)], iter(()), 0, 1, [replica.address], ipc_address("control"),
                    secret=KEY)

    def group(i: int) -> None:  # what the run loop does for one group (k = 0, B = 1: one group a version)
        router._handle(("version", 0, i))
        index = router.admission.admit(i)
        router._dispatch(index, 1, router.problems[index])
        router._flush()
        assert replica.recv(timeout_s=10.0)[1] == [(index, 1, {"q": index})]
        router._handle(("sent", 0, index, 1))
        router._handle(("received", index, 1))

    try:
        grown = _growth(WARM, n, group)
        router._handle(("sent", 0, n - 1, 1))  # a copy re-sent after a replica's restart: dropped, not counted
        assert router.admission.accepted == n and router.admission.running == 0
        assert router.in_flight == [{}] and router.unconfirmed == [{}]
    finally:
        router.control.close()
        router.outs[0].close()
        replica.close()
    assert grown < 4 * MORE, f"{grown} bytes over {MORE} groups"  # a tenth of ~40 bytes a group
