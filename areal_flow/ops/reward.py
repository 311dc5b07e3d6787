"""``ops.reward``: score every trajectory of a group with a rule reward.

Port schema: input ``rollouts``; output ``rewards`` (one float per trajectory).
``fn`` is a name from :data:`REWARD_FNS` or a callable ``fn(output_text, answer) -> float``
defined in the graph file (it reaches other processes through cloudpickle). A reward
function that raises is caught per sample, logged with the sample id, and scores 0.
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


def reward(rollouts: Handle, *, fn: str | Callable[[str, str], float] = "arithmetic", name: str | None = None) -> Handle:
    """Declare a rule reward over ``rollouts``.

    Raises:
        GraphError: ``fn`` is neither a known name nor callable (naming the node and line).
    """
    node = record(SPEC, {"rollouts": rollouts}, attrs={"fn": fn}, name=name)
    if not callable(fn) and fn not in REWARD_FNS:
        raise GraphError(f"{node.where()}: unknown reward fn {fn!r}; known: {', '.join(REWARD_FNS)} or a callable")
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
