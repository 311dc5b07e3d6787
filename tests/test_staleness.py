"""Admission rule, exactly-once consumption, and a randomized generator/trainer simulation."""

from __future__ import annotations

import random

import pytest

from areal_flow.types import Trajectory
from runtime.staleness import (
    AdmissionController,
    ExactlyOnceError,
    OrderedExperienceBuffer,
    StalenessViolation,
    VersionAheadError,
)


def _traj(group_id: int, j: int, versions: list[int]) -> Trajectory:
    return Trajectory(
        sample_id=f"{group_id}:{j}", group_id=group_id, prompt_ids=[1], output_ids=[2] * len(versions),
        behavior_logprobs=[0.0] * len(versions), versions=versions, finish_reason="stop",
    )


def test_sync_baseline_k0_b2_is_a_barrier():
    ac = AdmissionController(max_staleness=0, batch_groups=2)
    # capacity(0) = (0 + 0 + 1) * 2 = 2: exactly two admits at v=0
    assert ac.capacity(0) == 2
    assert ac.admit(0) == 0 and ac.admit(0) == 1
    assert not ac.can_admit(0)
    ac.complete(0)
    ac.complete(1)
    assert (ac.accepted, ac.running) == (2, 0)
    assert not ac.can_admit(0)  # completing does not free capacity: the version must advance
    with pytest.raises(StalenessViolation, match="capacity 2"):
        ac.admit(0)
    # v=1: capacity (0 + 1 + 1) * 2 = 4 → two more
    assert ac.can_admit(1)
    assert ac.admit(1) == 2 and ac.admit(1) == 3
    assert not ac.can_admit(1)


def test_capacity_k2_b3_at_v1():
    ac = AdmissionController(max_staleness=2, batch_groups=3)
    # (k + v + 1) * B = (2 + 1 + 1) * 3 = 12
    assert ac.capacity(1) == 12
    for expected in range(12):
        assert ac.can_admit(1)
        assert ac.admit() == expected
    assert (ac.accepted + ac.running) == 12 and not ac.can_admit(1)
    # completions move running → accepted; the sum (and so the refusal) is unchanged
    for i in (5, 0, 11):
        ac.complete(i)
    assert (ac.accepted, ac.running) == (3, 9) and not ac.can_admit(1)
    # v=2: (2 + 2 + 1) * 3 = 15
    assert ac.can_admit(2) and ac.capacity(2) == 15


def test_complete_twice_or_unknown_raises():
    ac = AdmissionController(1, 1)
    i = ac.admit()
    ac.complete(i)
    with pytest.raises(ExactlyOnceError, match="index 0"):
        ac.complete(i)
    with pytest.raises(ExactlyOnceError, match="index 7"):
        ac.complete(7)


def test_buffer_duplicate_put_raises_naming_index():
    buf = OrderedExperienceBuffer(batch_groups=2, max_staleness=1)
    buf.put(3, [_traj(3, 0, [0])])
    with pytest.raises(ExactlyOnceError, match="admission index 3"):
        buf.put(3, [_traj(3, 0, [0])])


def test_buffer_releases_in_admission_order_and_rejects_consumed_duplicates():
    buf = OrderedExperienceBuffer(batch_groups=2, max_staleness=0)
    buf.put(1, [_traj(1, 0, [0])])
    buf.put(2, [_traj(2, 0, [1])])
    assert not buf.ready(0)  # index 0 missing
    with pytest.raises(ValueError, match=r"missing admission indices \[0\]"):
        buf.take_batch(0)
    buf.put(0, [_traj(0, 0, [0]), _traj(0, 1, [0, 0])])
    assert buf.ready(0)
    with pytest.raises(ValueError, match="expected step 0"):
        buf.take_batch(1)
    batch = buf.take_batch(0)
    assert [g[0].group_id for g in batch] == [0, 1]
    assert buf.consumed_ids == {"0:0", "0:1", "1:0"} and buf.consumed_indices == {0, 1}
    with pytest.raises(ExactlyOnceError, match="admission index 0.*consumed"):
        buf.put(0, [_traj(0, 0, [0])])
    assert buf.pending == 1 and buf.next_step == 1


def test_buffer_staleness_violation_names_sample_and_consumes_nothing():
    buf = OrderedExperienceBuffer(batch_groups=1, max_staleness=1)
    buf.put(0, [_traj(0, 0, [0])])
    buf.take_batch(0)
    buf.put(1, [_traj(1, 0, [1])])
    buf.take_batch(1)
    # trained at step 2, first token from version 0: staleness 2 - 0 = 2 > k = 1
    buf.put(2, [_traj(2, 0, [1]), _traj(2, 1, [0, 1, 2])])
    with pytest.raises(StalenessViolation, match="'2:1'.*staleness 2 > max_staleness 1"):
        buf.take_batch(2)
    assert buf.pending == 1 and "2:0" not in buf.consumed_ids and buf.next_step == 2


def test_buffer_refuses_a_version_ahead_of_the_step_naming_it():
    buf = OrderedExperienceBuffer(batch_groups=1, max_staleness=2)
    # step 0: only version 0 exists; a token of version 1 is from the future
    buf.put(0, [_traj(0, 0, [0]), _traj(0, 1, [0, 1])])
    with pytest.raises(VersionAheadError, match=r"sample '0:1' \(group index 0\) carries policy version 1, "
                                                r"ahead of trainer step 0"):
        buf.take_batch(0)
    assert buf.next_step == 0 and not buf.consumed_ids


def test_buffer_duplicate_sample_id_across_groups_raises():
    buf = OrderedExperienceBuffer(batch_groups=2, max_staleness=0)
    buf.put(0, [_traj(0, 0, [0])])
    buf.put(1, [_traj(0, 0, [0])])  # same sample id in another group
    with pytest.raises(ExactlyOnceError, match="'0:0'"):
        buf.take_batch(0)


def _simulate(k_gen: int, k_train: int, batch_groups: int, n_steps: int, seed: int):
    """Single-process interleaving of one generator and one trainer.

    The generator admits groups under ``k_gen``, decodes one token of a random running
    sample per tick (tagging it with its current version), and loads newly published
    versions with a random lag. The trainer takes step ``s`` when its ``B`` groups have
    arrived, then publishes version ``s + 1``. Groups arrive in completion order.
    Returns ``(buffer, trained groups in consumption order, admitted count)``.
    """
    rng = random.Random(seed)
    n_groups = batch_groups * n_steps
    ac = AdmissionController(k_gen, batch_groups)
    buf = OrderedExperienceBuffer(batch_groups, k_train)
    gen_version, published, step = 0, 0, 0
    running: dict[int, list[tuple[Trajectory, int]]] = {}  # index → [(traj, target len)]
    trained: list[list[Trajectory]] = []
    for _ in range(200_000):
        if step == n_steps:
            break
        event = rng.random()
        if event < 0.25 and ac.accepted + ac.running < n_groups and ac.can_admit(gen_version):
            i = ac.admit(gen_version)
            n_samples = rng.randint(1, 3)
            running[i] = [(_traj(i, j, []), rng.randint(1, 12)) for j in range(n_samples)]
        elif event < 0.75 and running:
            i = rng.choice(list(running))
            unfinished = [(t, n) for t, n in running[i] if len(t.versions) < n]
            traj, _ = rng.choice(unfinished)
            traj.versions.append(gen_version)
            if all(len(t.versions) >= n for t, n in running[i]):
                ac.complete(i)
                buf.put(i, [t for t, _ in running.pop(i)])
        elif event < 0.85 and gen_version < published:
            gen_version = published  # newest version wins
        elif buf.ready(step):
            trained.append(buf.take_batch(step))
            step += 1
            published = step
    else:
        raise AssertionError("simulation did not finish: generator and trainer deadlocked")
    return buf, trained, ac.accepted + ac.running


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulation_bounded_staleness_and_exactly_once(k, seed):
    b, n_steps = 3, 25
    buf, trained, admitted = _simulate(k, k, b, n_steps, seed)
    # every admitted group is trained exactly once: 3 * 25 = 75 groups, indices 0..74
    assert admitted == b * n_steps
    assert buf.consumed_indices == set(range(b * n_steps)) and buf.pending == 0
    ids = [t.sample_id for batch in trained for g in batch for t in g]
    assert len(ids) == len(set(ids)) == len(buf.consumed_ids)
    for s, batch in enumerate(trained):
        assert [g[0].group_id for g in batch] == list(range(s * b, (s + 1) * b))
        for g in batch:
            for t in g:
                assert 0 <= s - t.start_version <= k, (t.sample_id, s, t.versions)
    # the bound is reached, not just respected (k = 0 ⇒ fully on-policy)
    assert buf.max_seen_staleness == k


def test_simulation_without_admission_bound_is_caught():
    # generator admits as if k = 4 while the trainer enforces k = 1: some sample must violate
    with pytest.raises(StalenessViolation, match="> max_staleness 1"):
        _simulate(4, 1, 3, 25, seed=0)
