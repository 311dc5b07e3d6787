"""Bounded-staleness control: generate-side admission and trainer-side ordered consumption.

Generation and training run at their own pace in separate processes. Staleness is bounded
by *admission control* on the generate side (:class:`AdmissionController`) together with
*ordered consumption* on the trainer side (:class:`OrderedExperienceBuffer`); no sample is
ever generated only to be thrown away for being too stale.

Notation: ``k`` = ``max_staleness`` (versions), ``B`` = train batch size in prompt groups,
``v`` = the generator's current policy version. Trainer step ``s`` computes gradients with
policy version ``s`` and publishes version ``s + 1``; both sides start from version 0.

Rules:

* Admission (generator): a new prompt group may start only while
  ``accepted + running < (k + v + 1) * B``; it receives the admission index
  ``i = accepted + running`` (the number of groups admitted before it).
* Consumption (trainer): the group with admission index ``i`` is trained at step
  ``floor(i / B)``; step ``s`` takes exactly the indices ``[s*B, (s+1)*B)``.

Claim: every trained sample has staleness ``s - start_version <= k``.

Proof. Every admitted group is completed and sent (nothing is discarded), so
``accepted + running`` is the number of groups admitted so far and indices are
``0, 1, 2, ...`` in admission order. A group admitted at generator version ``v_a`` has
index ``i < (k + v_a + 1) * B``, hence it is trained at step ``s = floor(i / B) <= k + v_a``.
The generator's version never decreases, so each of the group's tokens is produced by a
version ``>= v_a``, i.e. ``start_version >= v_a``. Therefore
``s - start_version <= s - v_a <= k``. ∎

Liveness: the trainer at step ``s`` has published version ``s``; once the generator has
loaded it, capacity is ``(k + s + 1) * B >= (s + 1) * B``, so every index step ``s`` needs can
be admitted — the two sides never deadlock. With ``k = 0`` the rule is the synchronous
baseline: at version ``v`` exactly the ``B`` groups of step ``v`` are admitted, then the
generator waits for version ``v + 1`` (a barrier).

Several step groups (a critic, or any ``batch`` node, on a mesh of its own; the chain of
``compiler.hosting``): every step group consumes by the rule above — the first takes indices
``[s*B, (s+1)*B)`` from the channels, each later one the same ``B`` groups, whole, from the
one before it — and checks them in its own :class:`OrderedExperienceBuffer`. The claim holds
in each: ``s - start_version`` depends only on the sample and on ``s``, not on which group
trains it at step ``s`` nor when, and the proof above uses nothing else. No sample of step
``s`` is ahead of version ``s``: version ``s + 1`` is published by the policy's trainer after
its own step ``s``, which needs those very groups, sent by a replica once complete (it holds
them from the channels, or through the chain), so their tokens came first. Liveness: a step
group's step ``s`` waits only for indices ``< (s + 1) * B``, admissible at version ``s``
(above), and for the step groups before it, which wait for the same; so the trainer's step
``s`` and the version ``s + 1`` it publishes always come, and a step group after the trainer
only lags it. Exactly-once: each step group puts every index in its buffer once (a step's
batch reaches the next group as one message) and its buffer refuses a second. Across a
resume (or every worker restarted) the same holds: every step group loads its own part of
one version ``v``, complete in every part (``runtime.checkpoint``), so every buffer starts at
step ``v``, the indices ``>= v * B`` are admitted again and the ones below are in no buffer;
no group resumes from a version another group has not reached. A forward-only
node of a trained model sits with that model's trainer (rule ``stale-weights``), so at step
``s`` it reads the model after ``s`` updates, as when everything ran in one process.

A second generate node fed by a per-group node (an LLM judge, ``runtime.executors.fed_generate``)
runs a frozen model (rule ``frozen-judge``; no weight route reaches it): a frozen model has
no versions, its engine holds version 0 for the whole run, so its tokens are never stale and
the bound is over the policy's tokens only (``start_version`` is read from the policy's
rollouts, ``runtime.groups.GroupItem.rollouts``). It runs inside a group's trip from the
policy's replica to the step groups, so it only delays a group, which the liveness argument
allows (a group's step waits for it, never the reverse); a lost verdict drops the group,
whose slot is resampled under the same index, as after a filter.

Experience replay (``ops.replay``, a ``batch`` node before the trainer) adds to step ``s``'s
batch rows already trained at an earlier step ``s0 < s``. They do not pass admission nor
this module's buffers: the fresh samples, and the argument above for them (claim, liveness,
exactly-once), are unchanged. The claim for a replayed row holds by construction: the replay
node keeps a row only while ``s - start_version <= k`` (it evicts it for good at the first
step where that fails; ``s`` only grows) and reads ``start_version`` from the row's own
per-token versions, kept from generation. Replay never waits for anything, so liveness is
untouched, and a replayed row is marked (``areal_flow.types.REPLAYED``) and counted apart.
"""

from __future__ import annotations

from collections.abc import Sequence

from areal_flow.types import Trajectory


class StalenessViolation(RuntimeError):
    """A sample would be trained more than ``max_staleness`` versions after its first token.

    Admission control makes this impossible; raising it means a broken invariant upstream
    (e.g. the generator admitted without :meth:`AdmissionController.can_admit`).
    """


class VersionAheadError(RuntimeError):
    """A sample carries a policy version the trainer has not published yet (versions only
    grow: at step ``s`` the newest published version is ``s``); a broken invariant upstream."""


class ExactlyOnceError(ValueError):
    """A group index or sample id was delivered, completed or consumed more than once."""


class AdmissionController:
    """Generate-side admission rule ``accepted + running < (k + v + 1) * B``.

    Args:
        max_staleness: ``k``, the largest allowed ``trainer step - start_version`` (versions).
            ``0`` is the synchronous baseline.
        batch_groups: ``B``, prompt groups per train step.

    k and B come from the plan, whose check (``compiler.plan_check``) made k an int >= 0 and
    B an int >= 1.

    Attributes:
        accepted: groups completed (and sent to the trainer) so far.
        running: groups admitted but not yet completed.
    """

    def __init__(self, max_staleness: int, batch_groups: int) -> None:
        self.max_staleness = max_staleness
        self.batch_groups = batch_groups
        self.accepted = 0
        self._running: set[int] = set()

    @property
    def running(self) -> int:
        """Groups in flight (admitted, not completed)."""
        return len(self._running)

    def capacity(self, version: int) -> int:
        """Groups that may have been admitted in total at policy ``version``: ``(k + v + 1) * B``."""
        if version < 0:
            raise ValueError(f"policy version must be >= 0, got {version}")
        return (self.max_staleness + version + 1) * self.batch_groups

    def can_admit(self, version: int) -> bool:
        """True when a new group may start under policy ``version``."""
        return self.accepted + self.running < self.capacity(version)

    def admit(self, version: int | None = None) -> int:
        """Start a group and return its admission index ``accepted + running``.

        Args:
            version: the generator's current policy version; when given, the rule is
                checked here too.

        Raises:
            StalenessViolation: ``version`` is given and :meth:`can_admit` is false.
        """
        if version is not None and not self.can_admit(version):
            raise StalenessViolation(
                f"admission refused at version {version}: accepted {self.accepted} + running "
                f"{self.running} >= capacity {self.capacity(version)}"
            )
        index = self.accepted + self.running
        self._running.add(index)
        return index

    def is_running(self, index: int) -> bool:
        """True while the group with admission ``index`` is admitted and not yet completed."""
        return index in self._running

    def complete(self, index: int) -> None:
        """Mark the group with admission ``index`` completed and sent (moves it running → accepted).

        Raises:
            ExactlyOnceError: ``index`` is not running (never admitted, or completed twice).
        """
        if index not in self._running:
            raise ExactlyOnceError(
                f"group with admission index {index} is not running "
                f"(never admitted or already completed); running: {sorted(self._running)}"
            )
        self._running.remove(index)
        self.accepted += 1


class OrderedExperienceBuffer:
    """Trainer-side buffer that releases groups in admission order, ``B`` per step.

    Step ``s`` consumes exactly the groups with admission indices ``[s*B, (s+1)*B)``, and
    steps are consumed in order ``0, 1, 2, ...``.

    Args:
        batch_groups: ``B``, prompt groups per train step (the plan's, checked there).
        max_staleness: ``k`` (the plan's, checked there); :meth:`take_batch` checks every
            sample against it.

    Attributes:
        next_step: the step :meth:`take_batch` expects next.
        consumed_ids: sample ids already handed to the trainer (exactly-once accounting).
        consumed_indices: admission indices already handed to the trainer.
        max_seen_staleness: largest ``step - start_version`` released so far (versions).
    """

    def __init__(self, batch_groups: int, max_staleness: int) -> None:
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.next_step = 0
        self.consumed_ids: set[str] = set()
        self.consumed_indices: set[int] = set()
        self.max_seen_staleness = 0
        self._pending: dict[int, list[Trajectory]] = {}

    @property
    def pending(self) -> int:
        """Groups received but not yet consumed."""
        return len(self._pending)

    def _indices(self, step: int) -> range:
        return range(step * self.batch_groups, (step + 1) * self.batch_groups)

    def put(self, index: int, group: Sequence[Trajectory]) -> None:
        """Store the group with admission ``index``.

        Raises:
            ValueError: negative ``index`` or empty ``group``.
            ExactlyOnceError: ``index`` already received or consumed.
        """
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"admission index must be an int >= 0, got {index!r}")
        if index in self._pending or index in self.consumed_indices:
            raise ExactlyOnceError(
                f"duplicate group with admission index {index}: it was already "
                f"{'received' if index in self._pending else 'consumed'} (exactly-once)"
            )
        if not group:
            raise ValueError(f"group with admission index {index} is empty")
        self._pending[index] = list(group)

    def ready(self, step: int) -> bool:
        """True when all ``B`` groups of ``step`` have arrived."""
        return all(i in self._pending for i in self._indices(step))

    def take_batch(self, step: int) -> list[list[Trajectory]]:
        """Remove and return the groups of ``step``, ordered by admission index.

        A trajectory with no generated token (``versions == []``) has no start version
        and carries no training signal; it is exempt from the staleness check.

        Raises:
            ValueError: ``step`` is not :attr:`next_step`, or some of its groups are missing.
            StalenessViolation: a sample has ``step - start_version > max_staleness``
                (names the sample id); nothing is consumed then.
            VersionAheadError: a sample has a token of a version ``> step`` (names the
                sample id, the version and the step); nothing is consumed then.
            ExactlyOnceError: a sample id was already consumed.
        """
        if step != self.next_step:
            raise ValueError(f"steps are consumed in order: expected step {self.next_step}, got {step}")
        indices = self._indices(step)
        missing = [i for i in indices if i not in self._pending]
        if missing:
            raise ValueError(f"step {step} is not ready: missing admission indices {missing}")
        batch = [self._pending[i] for i in indices]
        seen: set[str] = set()
        worst = 0
        for index, group in zip(indices, batch):
            for traj in group:
                if traj.sample_id in self.consumed_ids or traj.sample_id in seen:
                    raise ExactlyOnceError(
                        f"sample {traj.sample_id!r} (group index {index}) was already consumed"
                    )
                seen.add(traj.sample_id)
                if not traj.versions:
                    continue
                if max(traj.versions) > step:
                    raise VersionAheadError(
                        f"sample {traj.sample_id!r} (group index {index}) carries policy version "
                        f"{max(traj.versions)}, ahead of trainer step {step} (newest published: {step})"
                    )
                staleness = traj.staleness(step)
                if staleness > self.max_staleness:
                    raise StalenessViolation(
                        f"sample {traj.sample_id!r} (group index {index}) has start version "
                        f"{traj.start_version} and would be trained at step {step}: staleness "
                        f"{staleness} > max_staleness {self.max_staleness}"
                    )
                worst = max(worst, staleness)
        for i in indices:
            del self._pending[i]
        self.consumed_indices.update(indices)
        self.consumed_ids |= seen
        self.max_seen_staleness = max(self.max_seen_staleness, worst)
        self.next_step += 1
        return batch
