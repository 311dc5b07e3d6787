"""``ops.replay``: experience replay, a share of each train step's batch drawn from earlier steps.

Port schema: input ``advantages`` (the step's batch from ``ops.advantage``), output
``advantages`` (that batch with replayed rows appended: what a ``train_step`` consumes).
Grain ``batch``, no device: it runs once per train step in the trainer's worker group and
keeps a bounded buffer of the rows it has passed on (the seed's "experience replay ratio,
0.2-0.5").

At train step ``s`` (policy version ``s``, the trainer's, before the update) with ``N``
fresh rows, a node of ``ratio`` r and ``capacity`` C:

1. *eviction by staleness*: a buffered row whose oldest token was sampled by version
   ``v0`` (``Trajectory.start_version``) is dropped for good when ``s - v0 > k``, the
   ``max_staleness`` of the plan's trainer edge (``Plan.staleness_bound``); staleness only
   grows with ``s``, so no row older than k versions is ever trained;
2. *draw*: ``n = floor(r N / (1 - r))`` rows (so that ``n / (N + n) <= r``), rounded down
   to a multiple of the consuming trainer's ``dp x max(pp, micro-batches)`` (its ranks and
   micro-batches split the step's rows evenly, as ``compiler.executable``'s rules require
   of the fresh rows), at most the buffer holds, drawn uniformly without replacement
   (seeded by the run's seed and ``s``);
3. *output*: the fresh rows, then the replayed ones, every per-token tensor right-padded to
   the longest row (``versions`` with -1, the rest with 0: masked, as
   ``areal_flow.batching.collate`` pads); a replayed trajectory's ``meta`` gets
   :data:`areal_flow.types.REPLAYED` = the step that first trained it;
4. the step's fresh rows join the buffer; beyond C rows the oldest leave.

Replayed rows keep the behavior log-probs and per-token versions of their generation, so
the train_step's decoupled PPO loss (Fu et al. 2025, AReaL eq. 5; on by default with
``k >= 1``, ``compiler.algorithms``) weights them by ``pi_prox / pi_behav`` and clips
against the proximal policy, as it does fresh stale rows; their advantages are those the
advantage node gave them when they were fresh. Fresh samples are still trained exactly
once (``runtime.staleness``); replayed rows are counted apart, in the step's metrics
(``replay/*``, :meth:`ReplayBuffer.mix`) and in the trajectory log (their ``meta``). The
buffer is in each checkpoint (the executor is ``areal_flow.ops.interfaces.Checkpointed``),
so a resumed or restarted trainer draws the rows the uninterrupted run would; the draw
itself keeps no state (its generator is seeded by the run's seed and ``s`` alone).
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from areal_flow.graph import GraphError, OpSpec, PortSpec
from areal_flow.ops.registry import BATCH, CPU, OpDef, define, op_function
from areal_flow.tracing import Handle, outputs, record
from areal_flow.types import REPLAYED, Trajectory

SPEC = OpSpec(
    "replay",
    inputs=(PortSpec("advantages", "advantages"),),
    outputs=(PortSpec("advantages", "advantages"),),
)
OP = define(OpDef(SPEC, BATCH, CPU, "areal_flow.ops.replay:ReplayExecutor"))
PAD = {"versions": -1}
"""Padding of per-token tensors by key (others: 0), as ``areal_flow.batching.collate`` pads."""


def check_knobs(where: str, ratio, capacity) -> None:
    """Raise GraphError (``where``: the node) unless ``0 <= ratio < 1`` and ``capacity`` is an int >= 1."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
        raise GraphError(f"{where}: ratio={ratio!r}: the replayed share of a step's rows must be a number in [0, 1) "
                         "(the seed's range is 0.2-0.5)")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise GraphError(f"{where}: capacity={capacity!r}: the buffer's rows must be an int >= 1")


@op_function
def replay(advantages: Handle, *, ratio: float = 0.25, capacity: int = 256, name: str | None = None) -> Handle:
    """Declare an experience replay node between ``ops.advantage`` and a ``train_step``.

    Args:
        advantages: the ``advantages`` handle of ``ops.advantage``.
        ratio: the share of each step's rows drawn from earlier steps, in [0, 1) (module doc).
        capacity: rows the buffer keeps (the oldest leave first), >= 1.

    Raises:
        GraphError: a bad ``ratio`` or ``capacity`` (naming the node and line).
    """
    node = record(SPEC, {"advantages": advantages}, attrs={"ratio": ratio, "capacity": capacity}, name=name)
    check_knobs(node.where(), ratio, capacity)
    return outputs(node, SPEC)


@dataclass
class _Row:
    trajectory: Trajectory
    tensors: dict  # key -> the row's tensor (a clone), as in the batch less its first dimension
    first_step: int


class ReplayBuffer:
    """The buffer and draw of one replay node (module doc), torch tensors in and out.

    Args:
        ratio / capacity: the node's knobs. max_staleness: k. quantum: the replayed rows are
        a multiple of it (the consuming trainer's ``dp x max(pp, micro-batches)``). seed: of the draw.
    """

    def __init__(self, ratio: float, capacity: int, max_staleness: int, quantum: int = 1, seed: int = 0) -> None:
        self.ratio, self.capacity, self.k = ratio, capacity, max_staleness
        self.quantum, self.seed = max(1, quantum), seed
        self.rows: list[_Row] = []

    def state(self) -> dict:
        """The buffered rows, oldest first: ``{"rows": [{"trajectory", "tensors", "first_step"}]}``
        (``tensors``: key -> the row's tensor; shared with the buffer, which never changes them)."""
        return {"rows": [{"trajectory": r.trajectory, "tensors": r.tensors, "first_step": r.first_step}
                         for r in self.rows]}

    def load(self, state: dict) -> None:
        """Replace the buffer by the rows of ``state`` (from :meth:`state`).

        Raises:
            ValueError: ``state`` has no ``rows`` list of such rows, or more than ``capacity``.
        """
        rows = state.get("rows") if isinstance(state, dict) else None
        fields = {f.name for f in dataclasses.fields(_Row)}
        if not isinstance(rows, list) or not all(isinstance(r, dict) and set(r) == fields for r in rows):
            raise ValueError(f"replay: a buffer state is {{'rows': [{{{', '.join(sorted(fields))}}}]}}, "
                             f"got {type(state).__name__} {sorted(state) if isinstance(state, dict) else ''}")
        if len(rows) > self.capacity:
            raise ValueError(f"replay: the state holds {len(rows)} rows, more than capacity={self.capacity}")
        self.rows = [_Row(**r) for r in rows]

    def mix(self, step: int, adv):
        """The batch of train step ``step`` (an ``areal_flow.values.Advantages`` of ``N`` fresh rows)
        with replayed rows appended; its ``stats`` gain ``replay/samples`` (rows replayed),
        ``replay/share`` (of the step's rows), ``replay/evicted`` (rows dropped by staleness
        this step), ``replay/buffer`` (rows kept after the step) and ``replay/staleness_max``
        (versions, the oldest replayed row's; 0 when none).

        Raises:
            ValueError: a batch tensor whose first dimension is not ``N``, or keys other than
                the buffered rows' (naming the key).
        """
        import torch

        batch, fresh = adv.batch, len(adv.trajectories)
        for key, value in batch.items():
            if value.shape[0] != fresh:
                raise ValueError(f"replay: batch key {key!r} has {value.shape[0]} rows for {fresh} trajectories")
        kept = [r for r in self.rows if step - r.trajectory.start_version <= self.k]
        evicted, self.rows = len(self.rows) - len(kept), kept
        want = math.floor(self.ratio * fresh / (1 - self.ratio) + 1e-9)
        n = min(want, len(self.rows))
        n -= n % self.quantum
        picked = sorted(random.Random(self.seed * 1_000_003 + step).sample(range(len(self.rows)), n))
        chosen = [self.rows[i] for i in picked]
        for r in chosen:
            if set(r.tensors) != set(batch):
                raise ValueError(f"replay: step {step}'s batch has keys {sorted(batch)}, a buffered row of step "
                                 f"{r.first_step} has {sorted(r.tensors)}")
        out = {key: _stack([value[i] for i in range(fresh)] + [r.tensors[key] for r in chosen], PAD.get(key, 0), torch)
               for key, value in batch.items()} if chosen else dict(batch)
        replayed = [dataclasses.replace(r.trajectory, meta={**r.trajectory.meta, REPLAYED: r.first_step})
                    for r in chosen]
        self.rows.extend(_Row(t, {key: value[i].clone() for key, value in batch.items()}, step)
                         for i, t in enumerate(adv.trajectories))
        del self.rows[:max(0, len(self.rows) - self.capacity)]
        stats = {"replay/samples": float(n), "replay/share": n / (fresh + n), "replay/evicted": float(evicted),
                 "replay/buffer": float(len(self.rows)),
                 "replay/staleness_max": float(max((step - r.trajectory.start_version for r in chosen), default=0))}
        return dataclasses.replace(adv, batch=out, trajectories=[*adv.trajectories, *replayed],
                                   stats={**adv.stats, **stats})


def _stack(rows: list, pad: float, torch):
    """Stack row tensors, right-padding 1-D ones to the longest with ``pad``."""
    if rows[0].dim() == 0:
        return torch.stack(rows)
    width = max(r.shape[0] for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.shape[0]), value=pad) for r in rows])


class ReplayExecutor:
    """Worker side (grain ``batch``): ``run({"advantages": Advantages}, info) -> {"advantages": ...}``,
    one :class:`ReplayBuffer` per node for the run; ``info["step"]`` is the train step."""

    def __init__(self, node, ctx) -> None:
        self.node, plan = node, ctx.plan
        trainer = next((n for n in plan.nodes if n.trains and n.strategy is not None
                        and any(src == node.name for src, _ in n.inputs.values())), None)
        quantum = 1 if trainer is None else trainer.parallel.dp * max(trainer.parallel.pp, trainer.micro_batches or 1)
        self.buffer = ReplayBuffer(node.attrs["ratio"], node.attrs["capacity"], plan.staleness_bound, quantum,
                                   seed=ctx.seed)

    def run(self, inputs: dict, info: dict) -> dict:
        return {"advantages": self.buffer.mix(info["step"], inputs["advantages"])}

    def checkpoint_state(self) -> dict:
        """The buffer (:meth:`ReplayBuffer.state`), saved with each checkpoint."""
        return self.buffer.state()

    def load_checkpoint_state(self, state: dict) -> None:
        """Continue with the buffer of ``state``; ValueError naming the node when it is not one."""
        try:
            self.buffer.load(state)
        except ValueError as e:
            raise ValueError(f"node {self.node.name!r}: {e}") from e
