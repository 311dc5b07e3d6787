"""The interfaces between a worker and what it drives: op executors and generation engines.

Owns the protocols (``typing.Protocol``, checkable with ``isinstance``) that the runtime's
workers call and that executors and engines implement, so neither side probes the other
with ``hasattr``:

* :class:`Executor`: a ``group`` or ``batch`` node's executor, built as ``cls(node, ctx)``
  (:class:`ExecutorClass`), then ``run(inputs, info)`` once per group or per train step.
* :class:`Trainer`: the executor of a node that trains its model (role ``training``); the
  trainer's worker loop also takes its weights, checkpoints and final save from it.
* :class:`Checkpointed`: a ``batch`` executor that keeps state across train steps which
  decides what is trained (``ops.replay``'s buffer); the trainer saves it in each checkpoint
  and gives it back on a resume or a trainer restart.
* :class:`StreamExecutor`: a ``stream`` node's executor (generate, rollout), driven by a
  generation replica: groups in, finished groups out, weight updates in between.
* :class:`Engine`: the continuous-batching engine a stream executor drives (the embedded
  ``runtime.engines.generation.GenerationEngine``, ``runtime.engines.vllm_engine.VLLMEngine``).

It imports neither torch nor the runtime, so ``areal_flow.ops`` (whose built-in executors
implement :class:`Executor`), ``runtime.executors`` and ``runtime.engines`` can all import it.
Tensors are ``torch.Tensor``, requests and results ``runtime.engines.generation``'s types.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Executor(Protocol):
    """A ``group`` or ``batch`` node's executor.

    Attributes:
        node: the plan's node (``compiler.plan.NodePlan``) it runs.
    """

    node: Any

    def run(self, inputs: dict, info: dict) -> dict | None:
        """One group (grain ``group``) or one train step (grain ``batch``).

        Args:
            inputs: input port -> value (a ``batch`` node's port fed per group: the list of
                the step's ``B`` per-group values, in admission order).
            info: ``index`` and ``attempt`` (``group``); ``step``, ``publish`` and ``trace``
                (``batch``).

        Returns:
            output port -> value; ``None`` from a ``group`` executor drops the group.
        """


class ExecutorClass(Protocol):
    """The constructor shape of every executor: ``cls(node, ctx)``, with ``ctx`` the
    worker's ``runtime.context.WorkerContext``."""

    def __call__(self, node: Any, ctx: Any) -> Executor: ...


@runtime_checkable
class Trainer(Executor, Protocol):
    """The executor of a node that trains its model; ``run`` returns ``{"stats": {name:
    float}, "weights": state dict or None}`` (the weights when ``info["publish"]``)."""

    @property
    def world_size(self) -> int:
        """Processes (ranks) it trains on."""

    def current_state(self) -> dict:
        """The full weights now, between steps (name -> tensor, on CPU)."""

    def final_state(self) -> dict | None:
        """The weights after the last step; ends the other ranks' loops."""

    def save(self, folder: Path, state: dict | None = None) -> None:
        """Write the model (``state``, else its weights now) to ``folder``."""

    def save_sharded(self, folder: Path) -> None:
        """Every rank writes its shards of model and optimizer state to ``folder``."""

    def optimizer_state(self) -> dict | None:
        """The optimizer's ``state_dict`` (None on several ranks: :meth:`save_sharded`)."""

    def load_checkpoint(self, folder: Path, optimizer_state: dict | None, world_size: int = 1) -> None:
        """Continue from a checkpoint that ``world_size`` ranks wrote to ``folder``."""


@runtime_checkable
class Checkpointed(Protocol):
    """A ``batch`` node's executor whose state across train steps decides what is trained.

    The trainer's worker saves :meth:`checkpoint_state` in ``trainer_state.pt`` under the
    node's name with every checkpoint and, on a resume or a trainer restart, passes it back
    to :meth:`load_checkpoint_state` of the same node's new executor before the first step
    (``runtime.checkpoint``). A restored executor must then produce what the uninterrupted
    one would have at every later step.
    """

    def checkpoint_state(self) -> dict:
        """Its state after the last step run (``torch.save``-able: tensors, numbers, dataclasses)."""

    def load_checkpoint_state(self, state: dict) -> None:
        """Continue from ``state`` (from :meth:`checkpoint_state` of an executor of the same
        node); raises ValueError naming the node when ``state`` is not one."""


@runtime_checkable
class Engine(Protocol):
    """A continuous-batching generation engine.

    Attributes:
        version: the policy version of its weights (every sampled token carries it).
        max_batch_size: sequences decoded at once at most (its slots).
        dtype: ``torch.dtype`` of its weights. dtype_speedup: the measured decode-step speedup
            of that dtype over float32 when the engine chose it (``gen.dtype=auto``), else None.
        device: the torch device it decodes on (``"cpu"``, ``"cuda"``).
    """

    version: int
    max_batch_size: int
    dtype: Any
    dtype_speedup: float | None
    device: str

    def submit(self, request: Any) -> None:
        """Queue a ``GenerationRequest``. Raises ValueError for a request it refuses (named)."""

    def step(self) -> list:
        """One engine step; the ``GenerationResult`` of every request that finished in it."""

    def has_work(self) -> bool:
        """Whether a request is waiting or being decoded."""

    def num_active(self) -> int:
        """Sequences holding a slot now."""

    def update_weights(self, state_dict: dict, version: int) -> None:
        """Load ``version``'s weights between steps; in-flight sequences resume under them."""

    def reseed(self, seed: int) -> None:
        """Restart its sampling stream from ``seed`` (an engine whose stream is fixed at start keeps it)."""

    def close(self) -> None:
        """Free what it holds; unusable afterwards."""


@runtime_checkable
class StreamExecutor(Protocol):
    """A ``stream`` node's executor on one generation replica.

    Attributes:
        node: the plan's generator node. engine: the :class:`Engine` it drives.
        counts: its counters for the replica's report (``{name: int}``).
    """

    node: Any
    engine: Engine
    counts: dict

    @property
    def version(self) -> int:
        """The policy version it generates with."""

    def submit(self, index: int, attempt: int, problem: dict) -> None:
        """Start prompt group ``index`` (its ``attempt``-th prompt, a dataset row)."""

    def step(self) -> list:
        """One engine step; the groups finished since the last call: ``(index, attempt, trajectories)``."""

    def has_work(self) -> bool:
        """Whether a group is in flight."""

    def update_weights(self, state_dict: dict, version: int) -> None:
        """Load ``version`` between steps."""

    def occupancy(self) -> dict:
        """What the last engine step decoded, for its trace span (``rows``, ``slots``; may be empty)."""

    def report(self) -> dict:
        """Its counters for the replica's report (``counts``, and a rollout's ``episode_errors``)."""

    def close(self) -> None:
        """Stop what it started (its engine, an agent endpoint)."""
