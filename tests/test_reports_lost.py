"""Issue 26 (found by bench/chaos.py): on Ray, a SIGKILLed metrics queue actor (the one
carrying the trainer's step reports) crashed the driver with Ray's ``ActorDiedError``
traceback; it now restarts every worker from the last checkpoint, as a dead trainer does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def test_a_dead_metrics_queue_restarts_every_worker_like_a_dead_trainer():
    from ray.exceptions import ActorDiedError

    from runtime.driver import Driver
    from runtime.ray_scheduler import RayScheduler
    from runtime.restarts import StageDied

    class DeadQueue:
        def qsize(self) -> int:
            raise ActorDiedError()

    scheduler = RayScheduler.__new__(RayScheduler)  # no cluster: only its metrics queue matters here
    scheduler.sink = DeadQueue()
    driver = Driver.__new__(Driver)
    driver.scheduler = scheduler
    driver.router = SimpleNamespace(admission=SimpleNamespace(accepted=6, running=2))
    with pytest.raises(StageDied) as died:
        driver._log(logger=None)
    assert str(died.value).startswith("metrics queue died (")
    assert died.value.admitted == 6 + 2  # groups completed + in flight: admitted again after the checkpoint
    assert scheduler.sink is None and scheduler.metrics() == []  # the next attempt's addresses() makes a new one
