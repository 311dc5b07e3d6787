"""Restarts after a worker's death, the same for every scheduler (``local``, ``ray``).

Owns the restart budget (``scheduler.max_restarts``, shared by the restarts of a dead
generation replica and the restarts of every worker from the last complete checkpoint after
a trainer's death), the attempt loop that starts the run's workers again from that
checkpoint (``runtime.checkpoint``; version 0 without one), the console lines that say what
died, why, and what is replayed, the ``restarts`` block of ``summary.json``, and the line a
Ctrl-C leaves (the last checkpoint). How a scheduler notices a death and starts workers is
its own (``runtime.launch``, ``runtime.ray_scheduler``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.checkpoint import latest_checkpoint
from runtime.metrics import RunLogger


class WorkerFailed(RuntimeError):
    """A worker raised (the message holds its traceback), or workers died beyond
    ``scheduler.max_restarts``."""


class HostLost(Exception):
    """A dead worker's host is gone (a lost cluster node), so it cannot come back where it ran:
    every worker restarts from the last checkpoint, on hosts that remain (the message says which
    host was lost)."""


class ReportsLost(Exception):
    """What carries the trainer's step reports to the driver died (on Ray, the metrics queue
    actor): the steps it held are lost to the driver, so every worker restarts from the last
    checkpoint, as for a dead trainer (:class:`StageDied`; the trainer wrote those steps'
    ``steps.jsonl`` lines before the checkpoint, and the rewind logs them again).

    Args:
        name: what died (``metrics queue``). cause: why, in a few words.
    """

    def __init__(self, name: str, cause: str) -> None:
        super().__init__(f"{name} died ({cause})")
        self.name, self.cause = name, cause


class StageDied(Exception):
    """A non-generation worker (the trainer, or another stage worker) died without reporting
    (killed, out of memory, a crash in native code).

    Args:
        name: the worker, ``<group>/<rank>``. cause: why, in a few words (``exit code -9``).
        admitted: groups the router had admitted (completed + in flight) when it died.
    """

    def __init__(self, name: str, cause: str, admitted: int) -> None:
        super().__init__(f"{name} died ({cause})")
        self.name, self.cause, self.admitted = name, cause, admitted


@dataclass
class Restarts:
    """The restarts of one run (``summary.json`` ``restarts``).

    Attributes:
        limit: ``scheduler.max_restarts``, for replica and trainer restarts together.
        resumed_from: the checkpoint version a resumed run started from (None: a new run).
        replicas: generation replicas restarted. trainer: restarts of every worker from the
            last checkpoint. replayed: groups admitted after that checkpoint, admitted again.
        causes: each restart's cause, in order (its first line, at most 300 characters), so a
            run's ``summary.json`` says why it restarted after the console is gone.
    """

    limit: int
    resumed_from: int | None = None
    replicas: int = 0
    trainer: int = 0
    replayed: int = 0
    causes: list[str] = field(default_factory=list)

    @classmethod
    def for_run(cls, setup) -> "Restarts":
        """The budget of the run ``setup`` (a ``runtime.run_setup.RunSetup``) describes."""
        return cls(int(setup.plan.run["scheduler"].get("max_restarts", 0)),
                   setup.checkpoint.version if setup.checkpoint else None)

    @property
    def used(self) -> int:
        return self.replicas + self.trainer

    def check(self, what: str) -> None:
        """Raises WorkerFailed (naming ``what``, the death) when the budget is used up."""
        if self.used >= self.limit:
            raise WorkerFailed(f"worker {what}; restarts so far {self.used}, scheduler.max_restarts={self.limit}")

    def replica(self, name: str, cause: str, version: int, how: str = "restarting it") -> None:
        """Count the restart of generation replica ``name`` (dead of ``cause``), which resumes
        at policy ``version``, and say so on stderr.

        Raises:
            WorkerFailed: the restarts are used up.
        """
        self.check(f"{name} died ({cause})")
        self.replicas += 1
        self.causes.append(f"{name} died ({cause})".splitlines()[0][:300])
        print(f"areal-flow: {name} died ({cause}); {how} at policy version {version} ({self.used}/{self.limit})",
              file=sys.stderr)

    def from_checkpoint(self, setup, died: StageDied) -> None:
        """After ``died``: point ``setup.checkpoint`` at the run's last complete checkpoint
        (None: version 0), from which the next attempt starts every worker, count the groups
        admitted after it (admitted again under their indices) and say so on stderr.

        Raises:
            WorkerFailed: the restarts are used up.
        """
        self.check(str(died))
        self.trainer += 1
        self.causes.append(str(died).splitlines()[0][:300])
        setup.checkpoint = latest_checkpoint(setup.out_dir, say)
        version = setup.checkpoint.version if setup.checkpoint else 0
        first = version * setup.topo.batch_groups
        self.replayed += max(0, died.admitted - first)
        where = setup.checkpoint.folder.name if setup.checkpoint else "version 0 (no checkpoint yet)"
        again = (f"groups {first}..{died.admitted - 1} admitted after it are admitted again under their indices"
                 if died.admitted > first else "no group was admitted after it")
        print(f"areal-flow: {died}; restarting every worker from {where} at step {version} ({self.used}/{self.limit} "
              f"restarts): {again}, trajectories and events of steps >= {version} are rewound", file=sys.stderr)

    def block(self, workers: dict) -> dict:
        """``summary.json`` ``restarts``; ``workers``: the workers' reports (their ``duplicates``)."""
        return {"resumed_from_version": self.resumed_from, "trainer_restarts": self.trainer,
                "replica_restarts": self.replicas, "replayed_groups": self.replayed, "causes": self.causes,
                "dropped_duplicates": sum(w.get("duplicates", 0) for w in workers.values())}


def run_attempts(setup, restarts: Restarts, attempt: Callable[[RunLogger], dict]) -> tuple[RunLogger, dict]:
    """Run ``attempt(logger)`` (start every worker from ``setup.checkpoint``, run to the end,
    return the workers' reports) until one ends without a :class:`StageDied`; after each
    death the next attempt starts from the last complete checkpoint
    (:meth:`Restarts.from_checkpoint`) in the rewound run folder. Returns the last attempt's
    (open) logger and reports. ``attempt`` logs every step it got before it raises; a Ctrl-C
    then says which checkpoint a resume continues from (:func:`say_interrupted`).

    Raises:
        WorkerFailed: the restarts are used up (or ``attempt`` raised it).
        KeyboardInterrupt: Ctrl-C.
    """
    while True:
        logger = setup.logger(rewind=setup.checkpoint is not None or restarts.trainer > 0)
        try:
            return logger, attempt(logger)
        except StageDied as died:
            logger.close()
            restarts.from_checkpoint(setup, died)
        except KeyboardInterrupt:
            logger.close()
            first = setup.checkpoint.version if setup.checkpoint else 0
            say_interrupted(setup, first if logger.last_step is None else logger.last_step + 1)
            raise
        except BaseException:
            logger.close()
            raise


def say(line: str) -> None:
    """One ``areal-flow: <line>`` on stderr (e.g. a torn checkpoint skipped on the way to the
    one a resume or a restart continues from, ``runtime.checkpoint.latest_checkpoint``)."""
    print(f"areal-flow: {line}", file=sys.stderr)


def say_interrupted(setup, steps_logged: int) -> None:
    """Say on stderr, after a Ctrl-C (the workers stopped), how many steps were done (those
    logged, or the last checkpoint's version when higher: a trainer ended between its
    checkpoint and its report) and which checkpoint a ``--resume`` continues from (read from
    the run folder: the last complete one)."""
    last = latest_checkpoint(setup.out_dir)
    steps_done = max(steps_logged, last.version if last else 0)
    note = (f"last checkpoint: {last.folder} (areal-flow run ... --resume {setup.out_dir} continues from it)" if last
            else "no checkpoint was saved (train.checkpoint_every)")
    print(f"\nareal-flow: interrupted after {steps_done} of {setup.topo.steps} steps; {note}", file=sys.stderr)
