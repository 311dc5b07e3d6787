"""The values on a graph's ports: one class per port type, and what a value of each may be.

Every port of an op (``areal_flow.graph.PortSpec.type``) carries a value of the class its
type names here. The built-in executors produce and consume these classes; a user op
(``areal_flow.ops.register_op``) receives them and returns them, and what it returns is
checked against its declared ports with :func:`port_value` (``areal_flow.ops.function``).

============== ================ ==========================================================
port type      class            one value
============== ================ ==========================================================
``prompts``    :class:`Prompt`  one dataset row: the prompt of one admission slot (from a
                                group op: a list, one per sample, e.g. a judge's questions)
``rollouts``   :class:`Rollouts` one prompt group's trajectories, ``[n]``
``rewards``    :class:`Rewards` one scalar reward per trajectory of a group, ``[n]``
``logprobs``   :class:`Logprobs` per trajectory of a group, one log-prob per response token
``advantages`` :class:`Advantages` one train step's collated batch with its advantages
``stats``      :class:`Stats`   one train step's metrics, name -> float
``weights``    :class:`Weights` a model's parameters after a train step (the weight channel)
============== ================ ==========================================================

Grains (``areal_flow.ops.registry``): a ``group`` node receives and returns the values of
one prompt group. A ``batch`` node receives, on a port fed by ``group`` nodes, the list of
the step's ``B`` per-group values in admission order; it returns a per-sample type
(rollouts, rewards, logprobs) as such a list too, and the other types as one value.

Per-sample values (:class:`Rollouts`, :class:`Rewards`, :class:`Logprobs`) hold one entry
per trajectory of their group, in the group's order; a sample removed from a group (its
reward failed, ``runtime.groups``) is removed from each of them with ``select``.

A port type a graph file names that is none of these carries whatever its producer
returns, unchecked, and is never trimmed.

Imports no torch: tensors live only in :class:`Advantages` and :class:`Weights`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, TypedDict

from areal_flow.types import Trajectory

if TYPE_CHECKING:
    import torch


class PortValueError(ValueError):
    """A value that is not of its port's type. The message is one line; the run stops with it
    alone (``brief``: the launcher prints no traceback)."""

    brief = True


class Prompt(TypedDict):
    """One dataset row (port type ``prompts``): what the router hands a generator for one
    admission slot. A task adds its own keys (the env of a multi-turn task reads them).

    Keys:
        id: the problem's id in its task. prompt: the bare prompt text (``"37+58="``).
        answer: the reference answer a rule reward compares with.
    """

    id: int
    prompt: str
    answer: str


class _PerSample(Sequence):
    """A group's per-trajectory entries (module doc); subclasses name the field that holds them."""

    _entries: ClassVar[str]

    def _items(self) -> list:
        return getattr(self, self._entries)

    def __getitem__(self, i):
        return self._items()[i]

    def __len__(self) -> int:
        return len(self._items())

    def __iter__(self) -> Iterator:
        return iter(self._items())

    def select(self, keep: Sequence[int]):
        """A value of the same class holding the entries at positions ``keep``, in that order."""
        items = self._items()
        return type(self)([items[i] for i in keep])


@dataclass(eq=True)
class Rollouts(_PerSample):
    """One prompt group's trajectories (port type ``rollouts``).

    Attributes:
        trajectories: the group's ``n`` samples (:class:`~areal_flow.types.Trajectory`), in
            sample order; fewer than ``n_samples`` once failed samples left the group.
    """

    trajectories: list[Trajectory]
    _entries: ClassVar[str] = "trajectories"


@dataclass(eq=True)
class Rewards(_PerSample):
    """One scalar reward per trajectory of a group (port type ``rewards``).

    Attributes:
        values: ``[n]`` finite floats, reward units of the task (a rule reward: 1.0 right,
            0.0 wrong), in the group's order.
    """

    values: list[float]
    _entries: ClassVar[str] = "values"


@dataclass(eq=True)
class Logprobs(_PerSample):
    """Per trajectory of a group, the log-prob of each response token (port type ``logprobs``).

    Attributes:
        values: ``[n][response_len]`` floats, natural log, under the model of the node that
            made them (``ops.logprobs``: a frozen reference at the sampling temperature).
    """

    values: list[list[float]]
    _entries: ClassVar[str] = "values"


@dataclass
class Advantages:
    """One train step's batch with its advantages (port type ``advantages``): what
    ``ops.advantage`` makes and a ``train_step`` consumes. A batch user op between them
    receives it and returns it changed (``dataclasses.replace(value, batch={...})``).

    Attributes:
        batch: tensors of the step's ``N`` trajectories (``N = B * n``, rows in admission
            order), ``T`` = the longest prompt + response, tokens:
            ``input_ids [N, T]`` int64, ``attention_mask [N, T]`` int64, ``loss_mask [N, T]``
            float32 (1 on the policy's response tokens), ``behavior_logprobs [N, T]`` float32
            (natural log, 0 off the response), ``versions [N, T]`` int64 (policy version per
            token, -1 off the response), ``rewards [N]`` float32, ``group_ids [N]`` int64
            (admission index), ``advantages [N, T]`` float32; when available
            ``values`` / ``returns [N, T]`` float32 (a critic's), ``ref_logprobs [N, T]``
            float32 (a reference policy's), and for multi-turn episodes ``turn_ids [N, T]``
            int64 and ``turn_rewards [N, n_turns]`` float32 (``areal_flow.batching.collate``).
        trajectories: the ``N`` trajectories, row ``i`` of ``batch`` is ``trajectories[i]``.
        stats: step statistics of the advantage computation (``kl_ref_in_reward``: nats per
            token when a KL to the reference was folded into the reward); reported with the
            train step's metrics.
    """

    batch: dict[str, "torch.Tensor"]
    trajectories: list[Trajectory]
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class Stats:
    """One train step's metrics (port type ``stats``).

    Attributes:
        metrics: name -> float (``loss``, ``grad_norm``, ``clip_frac``, ...; units per
            metric, ``areal_flow.algorithms``), logged as ``train/<name>``.
    """

    metrics: dict[str, float]


@dataclass
class Weights:
    """A model's parameters after a train step (port type ``weights``; the weight channel).

    Attributes:
        state: parameter name -> tensor (the full state dict, on CPU, gathered over ranks),
            or None when nothing needs the weights after this step (no weight route to
            publish on and no checkpoint).
    """

    state: dict[str, "torch.Tensor"] | None


def describe(value: Any) -> str:
    """A few words on what ``value`` is, for an error message (``dict with keys [...]``)."""
    kind = type(value).__name__
    if isinstance(value, Mapping):
        return f"{kind} with keys {sorted(map(str, value))[:8]}"
    if isinstance(value, (list, tuple)):
        inner = sorted({type(v).__name__ for v in value})
        return f"{kind} of {len(value)} ({', '.join(inner) or 'empty'})"
    return f"{kind} {value!r:.60}"


def _count(name: str, got: int, samples: int | None) -> None:
    if samples is not None and got != samples:
        raise PortValueError(f"{got} {name} for its {samples} samples")


def _real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _as_list(value: Any) -> Any:
    """A numpy array or torch tensor as (nested) lists; anything else unchanged."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, (list, tuple)) else value


def _rollouts(value: Any, samples: int | None) -> Rollouts:
    if not isinstance(value, Rollouts):
        if not isinstance(value, (list, tuple)) or not all(isinstance(t, Trajectory) for t in value):
            raise PortValueError(f"got {describe(value)}; expected Rollouts (or a list of Trajectory)")
        value = Rollouts(list(value))
    _count("trajectories", len(value), samples)
    return value


def _rewards(value: Any, samples: int | None) -> Rewards:
    values = list(value.values) if isinstance(value, Rewards) else _as_list(value)
    if not isinstance(values, (list, tuple)):
        raise PortValueError(f"got {describe(value)}; expected Rewards (or a list of floats, one per sample)")
    _count("values", len(values), samples)
    for i, r in enumerate(values):
        if not _real(r) or not math.isfinite(r):
            raise PortValueError(f"sample {i} is {describe(r)}; expected a finite float")
    return Rewards([float(r) for r in values])


def _logprobs(value: Any, samples: int | None) -> Logprobs:
    values = list(value.values) if isinstance(value, Logprobs) else _as_list(value)
    if not isinstance(values, (list, tuple)):
        raise PortValueError(f"got {describe(value)}; expected Logprobs (or a list of per-token float lists)")
    _count("values", len(values), samples)
    for i, row in enumerate(values):
        row = _as_list(row)
        if not isinstance(row, (list, tuple)) or not all(_real(x) for x in row):
            raise PortValueError(f"sample {i} is {describe(row)}; expected a list of floats (one per response token)")
    return Logprobs([[float(x) for x in _as_list(row)] for row in values])


def _advantages(value: Any, samples: int | None) -> Advantages:
    if not isinstance(value, Advantages):
        raise PortValueError(f"got {describe(value)}; expected Advantages (return the value received, changed: "
                             "dataclasses.replace(advantages, batch={...}))")
    _count("trajectories", len(value.trajectories), samples)
    for key, tensor in value.batch.items():
        shape = tuple(getattr(tensor, "shape", ()))
        if not shape or shape[0] != len(value.trajectories):
            got = f"shape {list(shape)}" if shape else describe(tensor)
            raise PortValueError(f"batch['{key}'] is {got}; expected a tensor of {len(value.trajectories)} rows, "
                                 "one per trajectory")
    return value


def _stats(value: Any, samples: int | None) -> Stats:
    metrics = value.metrics if isinstance(value, Stats) else value
    if not isinstance(metrics, Mapping) or not all(isinstance(k, str) and _real(v) for k, v in metrics.items()):
        raise PortValueError(f"got {describe(value)}; expected Stats (or a dict of metric name -> float)")
    return Stats({k: float(v) for k, v in metrics.items()})


def _weights(value: Any, samples: int | None) -> Weights:
    if not isinstance(value, Weights):
        raise PortValueError(f"got {describe(value)}; expected Weights")
    return value


def _prompt(value: Any, samples: int | None) -> Prompt | list[Prompt]:
    if isinstance(value, (list, tuple)):  # a group op's: one prompt per sample (a judge's questions)
        _count("prompts", len(value), samples)
        return [_prompt(v, None) for v in value]
    if not isinstance(value, Mapping) or not isinstance(value.get("prompt"), str):
        raise PortValueError(f"got {describe(value)}; expected a Prompt (a dict with a str 'prompt'), or from a "
                             "per-group op a list of them, one per sample")
    return value


PORT_TYPES: dict[str, type] = {
    "prompts": Prompt, "rollouts": Rollouts, "rewards": Rewards, "logprobs": Logprobs,
    "advantages": Advantages, "stats": Stats, "weights": Weights,
}
"""Port type -> the class of its values (the module's table)."""
_CHECKS: dict[str, Callable[[Any, int | None], Any]] = {
    "prompts": _prompt, "rollouts": _rollouts, "rewards": _rewards, "logprobs": _logprobs,
    "advantages": _advantages, "stats": _stats, "weights": _weights,
}
PER_SAMPLE = ("rollouts", "rewards", "logprobs")
"""Port types whose value holds one entry per trajectory of a group."""
PER_STEP = ("advantages",)
"""Port types whose value covers every trajectory of a train step."""


def port_value(port_type: str, value: Any, samples: int | None = None) -> Any:
    """``value`` as the class of ``port_type`` (a list of floats becomes :class:`Rewards`).

    Args:
        port_type: the port's type (``PortSpec.type``); a type not in the module's table
            returns ``value`` unchanged.
        value: one value: of one group for a per-sample type (:data:`PER_SAMPLE`).
        samples: the trajectories the value must cover: the group's for a per-sample type,
            the step's for ``advantages``; None: not checked.

    Raises:
        PortValueError: the value is not of the type, or covers another number of
            trajectories (says what came back and what was expected).
    """
    check = _CHECKS.get(port_type)
    return value if check is None else check(value, samples)
