"""Reliability (issue 13): late duplicates, failing rewards, versions, EOS ids, empty
responses, run folders. Hand-computed expectations; loopback only; seconds each."""

from __future__ import annotations

from types import SimpleNamespace

from areal_flow.types import Trajectory
from runtime.staleness import OrderedExperienceBuffer
from runtime.workers import GroupItem, file_group

PLAN = SimpleNamespace(nodes=[SimpleNamespace(name="generate", grain="stream")])


def _traj(index: int, j: int, version: int = 0, text: str = "1") -> Trajectory:
    return Trajectory(f"{index}:{j}", index, [1], [5], [-0.5], [version], "stop", output_text=text,
                      meta={"answer": "1"})


def _item(index: int, n: int = 2) -> GroupItem:
    return GroupItem(index, 1, {"generate.rollouts": [_traj(index, j) for j in range(n)]})


def test_a_late_duplicate_group_is_dropped_and_counted_held_or_trained():
    buffer, items, counts = OrderedExperienceBuffer(batch_groups=2, max_staleness=1), {}, {"duplicates": 0}
    assert file_group(_item(0), items, buffer, counts, PLAN)
    assert not file_group(_item(0), items, buffer, counts, PLAN)  # held: dropped
    assert file_group(_item(1), items, buffer, counts, PLAN)
    buffer.take_batch(0)  # indices 0 and 1 trained (the trainer pops them from items)
    items.clear()
    assert not file_group(_item(1), items, buffer, counts, PLAN)  # trained: dropped
    assert counts["duplicates"] == 2 and buffer.pending == 0
