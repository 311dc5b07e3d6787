"""``ops.reward``: score every trajectory of a group, with a rule or a reward model.

Port schema: input ``rollouts``; output ``rewards`` (one float per trajectory, in the
group's order). Either ``fn`` — a name from :data:`REWARD_FNS` or a callable
``fn(output_text, answer) -> float`` defined in the graph file (it reaches other processes
by value through cloudpickle) — or ``model=`` a frozen reward model
(``areal_flow.models.reward_model.RewardModel``: the sigmoid of its score on prompt +
response, in [0, 1]). A reward model node is an ``inference`` node for the compiler; a
rule reward is ``cpu``, placed with its generator, so rewards travel with the experience.

``overlong=(L_max, L_cache)``: DAPO's soft overlong punishment (Yu et al. 2025, §3.4,
eq. 13) added to every reward (``areal_flow.algorithms.dapo.overlong_penalty``). DAPO's
dynamic sampling is a node of its own: ``ops.filter``.

Failing rule rewards never poison a batch: calls run in a thread pool with a per-call
timeout (``reward.timeout_s``, ``reward.workers``); a sample whose call raises, times out or
returns a non-finite value is marked failed, dropped from its group before any statistic
(a group left empty is resampled like a filter drop), counted, and logged once per kind;
the run stops when more than ``reward.max_failure_fraction`` of the last
``reward.failure_window`` samples failed (``areal_flow.rewards.pool``).
"""

from __future__ import annotations

import difflib
from typing import Callable

from areal_flow.tracing import Handle, Model, outputs, record
from areal_flow.graph import GraphError, OpSpec, PortSpec
from areal_flow.ops.registry import CPU, GROUP, INFERENCE, OpDef, define, op_function
from areal_flow.types import Trajectory
from areal_flow.values import Rewards

SPEC = OpSpec("reward", inputs=(PortSpec("rollouts", "rollouts"),), outputs=(PortSpec("rewards", "rewards"),))
OP = define(OpDef(SPEC, GROUP, lambda node: INFERENCE if node.model else CPU, "areal_flow.ops.reward:RewardExecutor"))



def _arithmetic(output_text: str, answer: str) -> float:
    from areal_flow.tasks.arithmetic import ArithmeticTask

    return ArithmeticTask.reward(output_text, answer)


def _longtail(output_text: str, answer: str) -> float:
    from areal_flow.tasks.longtail import LongTailTask

    return LongTailTask.reward(output_text, answer)


def _math(output_text: str, answer: str) -> float:
    from areal_flow.rewards.math import math_reward

    return math_reward(output_text, answer)


def _reasoning_gym(output_text: str, answer: str) -> float:
    from areal_flow.tasks.rgym import reward

    return reward(output_text, answer)


REWARD_FNS: dict[str, Callable[[str, str], float]] = {"arithmetic": _arithmetic, "gsm8k": _math, "math": _math,
                                                      "longtail": _longtail, "reasoning_gym": _reasoning_gym}


@op_function
def reward(
    rollouts: Handle,
    *,
    fn: str | Callable[[str, str], float] | None = None,
    model: Model | None = None,
    overlong: tuple[int, int] | None = None,
    name: str | None = None,
) -> Handle:
    """Declare the reward of ``rollouts``: a rule ``fn`` or a reward ``model``.

    Args:
        fn: reward function name (:data:`REWARD_FNS`) or ``fn(output_text, answer) -> float``;
            ``"arithmetic"`` when neither ``fn`` nor ``model`` is given.
        model: a frozen reward model (``Model(..., trainable=False)``), instead of ``fn``.
        overlong: ``(L_max, L_cache)`` in tokens for DAPO's soft overlong punishment, or
            None (also when ``L_cache`` is 0) for none.

    Raises:
        GraphError: both ``fn`` and ``model``, ``fn`` neither a known name
            nor callable (naming the nearest known name), a trainable reward model, or ``overlong`` not
            ``0 < L_cache <= L_max`` (naming the node and line).
    """
    if overlong is not None and not overlong[1]:
        overlong = None
    if fn is None and model is None:
        fn = "arithmetic"
    attrs = {"fn": fn, "overlong": None if overlong is None else list(overlong)}
    node = record(SPEC, {"rollouts": rollouts}, model=model, attrs=attrs, name=name)
    if fn is not None and model is not None:
        raise GraphError(f"{node.where()}: give the reward either fn= (a rule) or model= (a reward model), not both")
    if model is not None and model.trainable:
        raise GraphError(f"{node.where()}: reward model '{model.name}' must be declared Model(..., trainable=False)")
    if fn is not None and not callable(fn) and fn not in REWARD_FNS:
        near = difflib.get_close_matches(str(fn), list(REWARD_FNS), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise GraphError(f"{node.where()}: unknown reward fn {fn!r}; {hint}known: {', '.join(REWARD_FNS)} or a callable")
    if overlong is not None and (len(overlong) != 2 or not 0 < overlong[1] <= overlong[0]):
        raise GraphError(f"{node.where()}: overlong={tuple(overlong)!r}: expected (L_max, L_cache), 0 < L_cache <= L_max")
    return outputs(node, SPEC)


def resolve(fn: str | Callable[[str, str], float]) -> Callable[[str, str], float]:
    """The callable behind a reward node's ``fn`` attribute."""
    return fn if callable(fn) else REWARD_FNS[fn]


def score(group: list[Trajectory], pool, monitor=None) -> list[float]:
    """Rewards of a group, its calls spread over ``pool`` (``areal_flow.rewards.pool.RewardPool``).

    A sample whose call raised, ran past the pool's timeout or returned a non-finite value
    is marked ``meta["reward_failed"] = kind`` (exception type name, ``"TimeoutError"`` or
    ``"non-finite"``) and scored 0.0, a placeholder: the runtime removes it from its group
    before any group statistic or loss (``runtime.groups.drop_failed_samples``). ``monitor``
    (``FailureMonitor``) counts and logs failures and raises ``FailureFractionError`` past
    its fraction.
    """
    outcomes = pool.map([(t.output_text, t.meta.get("answer", "")) for t in group])
    for t, outcome in zip(group, outcomes):
        if outcome.failed:
            t.meta["reward_failed"] = outcome.kind
        if monitor is not None:
            monitor.record(outcome, t.sample_id)
    return [0.0 if o.failed else o.value for o in outcomes]


class RewardExecutor:
    """Worker side of a reward node (grain ``group``): ``{"rewards": Rewards}``, one per trajectory.

    A rule reward calls ``fn`` per trajectory in a pool (:func:`score`); a reward model scores prompt + response ids
    (``[n, T]`` right-padded, one forward) and returns ``sigmoid(score)``. The overlong
    penalty is added last. Each trajectory's ``reward`` is set too (it is logged).
    """

    def __init__(self, node, ctx) -> None:
        from areal_flow.rewards.pool import FailureMonitor, RewardPool

        self.node = node
        self.fn = None if node.attrs.get("fn") is None else resolve(node.attrs["fn"])
        a = node.attrs
        self.pool = self.monitor = None
        if self.fn is not None:
            self.pool = RewardPool(self.fn, workers=a.get("workers", 4), timeout_s=a.get("timeout_s", 10.0))
            name = a["fn"] if isinstance(a["fn"], str) else getattr(self.fn, "__name__", "callable")
            self.monitor = FailureMonitor(f"reward node '{node.name}' (fn {name})",
                                          a.get("max_failure_fraction", 0.5), a.get("failure_window", 200))
        self.model = ctx.model(node.model) if node.model else None
        self.pad_id = ctx.pad_id
        self.overlong = node.attrs.get("overlong")

    def run(self, inputs: dict, info: dict) -> dict:
        import torch  # worker side only: tracing a graph does not import torch

        from areal_flow.algorithms.dapo import overlong_penalty

        group = inputs["rollouts"]
        if self.fn is not None:
            rewards = score(group, self.pool, self.monitor)
        else:
            from areal_flow.batching import pad_tokens

            with torch.no_grad():
                rewards = torch.sigmoid(self.model(*pad_tokens(group, self.pad_id)).float()).tolist()
        if self.overlong is not None:
            lengths = torch.tensor([len(t.output_ids) for t in group])
            penalty = overlong_penalty(lengths, max_length=self.overlong[0], cache_length=self.overlong[1])
            rewards = [r + p for r, p in zip(rewards, penalty.tolist())]
        for traj, r in zip(group, rewards):
            traj.reward = r
        return {"rewards": Rewards([float(r) for r in rewards])}
