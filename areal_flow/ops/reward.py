"""``ops.reward``: score every trajectory of a group with a rule reward.

Port schema: input ``rollouts``; output ``rewards`` (one float per trajectory).
``fn`` is a name from :data:`REWARD_FNS` or a callable ``fn(output_text, answer) -> float``
defined in the graph file (it reaches other processes through cloudpickle). A reward
function that raises is caught per sample, logged with the sample id, and scores 0.

Two data-side techniques of DAPO (Yu et al. 2025) are attributes of this node, because
they act where rewards are computed: on the generation side, before the experience
channel (the compiler places a rule reward with its generator):

* ``overlong=(L_max, L_cache)``: soft overlong punishment (§3.4, eq. 13) added to every
  reward (``areal_flow.algorithms.dapo.overlong_penalty``).
* ``keep="informative"``: dynamic sampling (§3.2). A group whose rewards are all equal
  has zero group-relative advantage; it is not sent but replaced by a new prompt under
  the same batch slot (admission index), at most ``max_attempts`` prompts per slot.
"""

from __future__ import annotations

import logging
from typing import Callable

from areal_flow.dsl import Handle, outputs, record
from areal_flow.graph import GraphError, OpSpec, PortSpec
from areal_flow.types import Trajectory

SPEC = OpSpec("reward", inputs=(PortSpec("rollouts", "rollouts"),), outputs=(PortSpec("rewards", "rewards"),))

logger = logging.getLogger(__name__)


def _arithmetic(output_text: str, answer: str) -> float:
    from areal_flow.tasks.arithmetic import ArithmeticTask

    return ArithmeticTask.reward(output_text, answer)


def _math(output_text: str, answer: str) -> float:
    from areal_flow.rewards.math import math_reward

    return math_reward(output_text, answer)


REWARD_FNS: dict[str, Callable[[str, str], float]] = {"arithmetic": _arithmetic, "gsm8k": _math, "math": _math}


KEEP = ("all", "informative")


def reward(
    rollouts: Handle,
    *,
    fn: str | Callable[[str, str], float] = "arithmetic",
    overlong: tuple[int, int] | None = None,
    keep: str = "all",
    max_attempts: int = 1,
    name: str | None = None,
) -> Handle:
    """Declare a rule reward over ``rollouts``.

    Args:
        fn: reward function name (:data:`REWARD_FNS`) or ``fn(output_text, answer) -> float``.
        overlong: ``(L_max, L_cache)`` in tokens for DAPO's soft overlong punishment, or
            None (also when ``L_cache`` is 0) for none.
        keep: ``"all"``, or ``"informative"`` to drop groups whose rewards are all equal
            and resample their slot (DAPO dynamic sampling).
        max_attempts: with ``keep="informative"``, prompts tried per slot (>= 1).

    Raises:
        GraphError: ``fn`` is neither a known name nor callable, ``keep`` is unknown,
            ``max_attempts < 1`` or ``overlong`` is not ``0 <= L_cache <= L_max``
            (naming the node and line).
    """
    if overlong is not None and not overlong[1]:
        overlong = None
    attrs = {"fn": fn, "keep": keep, "max_attempts": max_attempts, "overlong": None if overlong is None else list(overlong)}
    node = record(SPEC, {"rollouts": rollouts}, attrs=attrs, name=name)
    if not callable(fn) and fn not in REWARD_FNS:
        raise GraphError(f"{node.where()}: unknown reward fn {fn!r}; known: {', '.join(REWARD_FNS)} or a callable")
    if keep not in KEEP:
        raise GraphError(f"{node.where()}: keep={keep!r}; expected one of {KEEP}")
    if not isinstance(max_attempts, int) or max_attempts < 1:
        raise GraphError(f"{node.where()}: max_attempts={max_attempts!r}: must be an int >= 1")
    if overlong is not None and (len(overlong) != 2 or not 0 < overlong[1] <= overlong[0]):
        raise GraphError(f"{node.where()}: overlong={tuple(overlong)!r}: expected (L_max, L_cache), 0 < L_cache <= L_max")
    return outputs(node, SPEC)


def resolve(fn: str | Callable[[str, str], float]) -> Callable[[str, str], float]:
    """The callable behind a reward node's ``fn`` attribute."""
    return fn if callable(fn) else REWARD_FNS[fn]


def score(group: list[Trajectory], fn: Callable[[str, str], float]) -> list[float]:
    """Rewards of a group; a sample whose reward function raises is logged and scored 0.0."""
    from areal_flow.rewards.math import safe_reward

    for traj in group:
        traj.reward = safe_reward(fn, traj.output_text, traj.meta.get("answer", ""), traj.sample_id, logger)
    return [traj.reward for traj in group]


class DynamicSamplingError(RuntimeError):
    """A batch slot got ``max_attempts`` groups in a row whose rewards were all equal."""


class RewardRunner:
    """The worker side of a reward node: score a finished group, shape, filter.

    Args:
        attrs: the node's attributes (``fn``, ``keep``, ``max_attempts``, ``overlong``).
        node: the node's name, for error messages.
    """

    def __init__(self, attrs: dict, node: str = "reward") -> None:
        self.fn = resolve(attrs["fn"])
        self.keep = attrs.get("keep", "all")
        self.max_attempts = attrs.get("max_attempts", 1)
        self.overlong = attrs.get("overlong")
        self.node = node

    def __call__(self, group: list[Trajectory], slot: int, attempt: int) -> bool:
        """Set every trajectory's ``reward``; True to send the group, False to replace it.

        Args:
            group: the finished trajectories of one prompt.
            slot: the group's admission index (named in the error).
            attempt: 1 for the slot's first prompt, +1 per replacement.

        Raises:
            DynamicSamplingError: ``keep="informative"``, the group is all-equal and
                ``attempt >= max_attempts``; the message names the node, slot and reward.
        """
        import torch  # worker side only: tracing a graph does not import torch

        from areal_flow.algorithms.dapo import is_informative, overlong_penalty

        score(group, self.fn)
        if self.overlong is not None:
            lengths = torch.tensor([len(t.output_ids) for t in group])
            penalty = overlong_penalty(lengths, max_length=self.overlong[0], cache_length=self.overlong[1])
            for traj, p in zip(group, penalty.tolist()):
                traj.reward += p
        for traj in group:
            traj.meta["attempt"] = attempt
        if self.keep == "all":
            return True
        if is_informative(group):
            return True
        if attempt >= self.max_attempts:
            raise DynamicSamplingError(
                f"dynamic sampling (node '{self.node}'): batch slot {slot} drew {attempt} prompt groups in a row "
                f"whose rewards were all equal (last: {group[0].reward!r} x {len(group)}); raise "
                "reward.max_attempts or check the reward function and the model's accuracy"
            )
        return False
