"""Non-finite train steps: counted, their batch kept on disk, a run of them stops the run.

Owns what a trainer node (``train_step``) does after a step whose loss or gradient norm was
NaN or inf. The optimizer step itself is skipped where the gradient is known, before the update
(``areal_flow.algorithms.base.BaseAlgorithm.update_parameters`` and ``critic_update``
zero the gradients instead of stepping when the clipped global norm is not finite; a NaN
or inf loss reaches every parameter it depends on through backward, so its gradient norm is
not finite either). This module, called once per step by the train_step executor
(:meth:`NonFiniteGuard.check`):

* counts the step (``kinds["nonfinite_step"]``, which the trainer's summary reports as
  ``"<node>/failures"`` in ``summary.json``; the step's stats carry the running total,
  ``nonfinite_steps``, which TensorBoard logs as ``train/nonfinite_steps``);
* keeps the step's input on disk in the record format of ``runtime.record``
  (``<run>/nonfinite/<src>-<node>/meta.json`` and ``step_<n>.pt``, ``value`` = what the
  node received on its one data input port, ``advantages`` for ``train_step``), so the
  batch can be loaded and studied offline (docs/DEBUGGING.md); batches kept earlier (a resumed run, a replay) stay;
* raises :class:`NonFiniteStepError` when ``train.max_nonfinite_steps`` steps in a row
  were non-finite (a finite step resets the count).

Must not: train, or decide whether the optimizer steps (the algorithms do).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from areal_flow.config import TrainConfig
from areal_flow.values import Advantages
from runtime.record import EdgeRecorder
from runtime.topology import trainer_input

NONFINITE_DIR = "nonfinite"
KIND = "nonfinite_step"
WATCHED = ("loss", "grad_norm", "value_loss", "critic_grad_norm")
"""Stats of a train step (``BaseAlgorithm.update_parameters``, ``critic_update``) whose
non-finite value marks the step non-finite."""


class NonFiniteStepError(RuntimeError):
    """``max_nonfinite_steps`` train steps in a row had a NaN/inf loss or gradient norm
    (names the node, the steps and where their batches were kept)."""


def nonfinite_stats(stats: dict) -> dict[str, float]:
    """The watched stats (:data:`WATCHED`) of one step that are NaN or +-inf; none for an fp16
    loss-scale overflow (``loss_scale_overflow``: finite loss, scaled gradients overflowed), the
    dynamic loss scale's signal to back off (``areal_flow.algorithms.loss_scale``); likewise no
    ``critic_grad_norm`` for a critic's overflow (``critic_loss_scale_overflow``)."""
    if stats.get("loss_scale_overflow"):
        return {}
    skip = {"critic_grad_norm"} if stats.get("critic_loss_scale_overflow") else set()
    return {k: float(stats[k]) for k in WATCHED
            if k in stats and k not in skip and not math.isfinite(float(stats[k]))}


@dataclass
class NonFiniteGuard:
    """One trainer node's watch over its steps (module doc).

    Args:
        node: the trainer node's name. src: the node feeding its data input ``port``.
        run_dir: the run folder. max_steps: non-finite steps in a row that stop the run
            (``train.max_nonfinite_steps``, >= 1). port: the node's one data input. seed / threads / folders: written to
            the record's ``meta.json`` as ``runtime.record`` does.

    Attributes:
        kinds: ``{"nonfinite_step": n}``, the run's non-finite steps (the trainer's summary
            collects it with the rule rewards' failure counts, ``runtime.groups.failure_counts``).
        in_a_row: non-finite steps since the last finite one. steps: their step numbers.
    """

    node: str
    src: str
    run_dir: Path
    max_steps: int
    port: str
    seed: int = 0
    threads: int = 1
    folders: dict = field(default_factory=dict)
    kinds: Counter = field(default_factory=Counter)
    in_a_row: int = 0
    steps: list[int] = field(default_factory=list)
    _recorder: EdgeRecorder | None = None

    @classmethod
    def for_node(cls, node, ctx) -> "NonFiniteGuard":
        """The guard of trainer ``node`` (its ``max_nonfinite_steps`` attribute, from
        ``train.max_nonfinite_steps``) in the worker context ``ctx``.

        Raises:
            runtime.topology.TopologyError: the node has not exactly one data input."""
        port = trainer_input(node)
        return cls(node.name, node.inputs[port][0], ctx.out_dir,
                   int(node.attrs.get("max_nonfinite_steps", TrainConfig.max_nonfinite_steps)), port, seed=ctx.seed,
                   threads=ctx.threads, folders={k: str(v) for k, v in ctx.folders.items()})

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"train_step '{self.node}': train.max_nonfinite_steps={self.max_steps}: must be >= 1")

    @property
    def folder(self) -> Path:
        """``<run>/nonfinite/<src>-<node>``: where the non-finite steps' batches are kept."""
        return Path(self.run_dir) / NONFINITE_DIR / f"{self.src}-{self.node}"

    def check(self, step: int, stats: dict, value: Advantages) -> dict[str, float]:
        """Look at one finished step; return ``{"nonfinite_steps": total so far}`` for its stats.

        Args:
            step: the train step (0-based). stats: what the step returned (``loss``,
                ``grad_norm``, ...). value: the node's data input (an
                ``areal_flow.values.Advantages``: its ``trajectories``' ``group_id`` is the admission
                index and ``meta["attempt"]`` the attempt, 1 when absent).

        Raises:
            NonFiniteStepError: this was the ``max_steps``-th non-finite step in a row.
        """
        bad = nonfinite_stats(stats)
        if not bad:
            self.in_a_row, self.steps = 0, []
            return {"nonfinite_steps": float(self.kinds[KIND])}
        self.kinds[KIND] += 1
        self.in_a_row += 1
        self.steps.append(step)
        self._keep(step, value)
        if self.in_a_row >= self.max_steps:
            shown = ", ".join(f"{k} {v}" for k, v in bad.items())
            raise NonFiniteStepError(
                f"train_step '{self.node}': {self.in_a_row} steps in a row with a non-finite loss or gradient "
                f"(steps {', '.join(map(str, self.steps))}; at step {step}: {shown}); each was skipped and its "
                f"batch kept under {self.folder}; lower train.lr, or raise train.max_nonfinite_steps "
                f"(now {self.max_steps})")
        return {"nonfinite_steps": float(self.kinds[KIND])}

    def _keep(self, step: int, value: Advantages) -> None:
        if self._recorder is None:
            self._recorder = EdgeRecorder.start(self.run_dir, self.src, self.node, self.port, threads=self.threads,
                                                seed=self.seed, folders=self.folders, root=NONFINITE_DIR)
        trajectories = list(value.trajectories)
        groups: dict[int, int] = {}
        for t in trajectories:
            groups.setdefault(t.group_id, int(t.meta.get("attempt", 1)))
        self._recorder.item(step, value, list(groups), list(groups.values()), trajectories)
