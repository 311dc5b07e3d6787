"""``ops.advantage``: turn rewards (and critic values) into per-token advantages.

Port schema: inputs ``rollouts`` and ``rewards``; output ``advantages`` (the trajectories
with their advantages, what a ``train_step`` consumes). ``estimator`` names one of
``areal_flow.algorithms.advantages.ESTIMATORS``; extra keyword arguments go to it
(e.g. ``std="unbiased"``, ``gamma``, ``lam``).
"""

from __future__ import annotations

from areal_flow.dsl import Handle, Model, outputs, record
from areal_flow.graph import OpSpec, PortSpec

SPEC = OpSpec(
    "advantage",
    inputs=(PortSpec("rollouts", "rollouts"), PortSpec("rewards", "rewards")),
    outputs=(PortSpec("advantages", "advantages"),),
)


def advantage(
    rollouts: Handle,
    rewards: Handle,
    *,
    estimator: str = "grpo",
    critic: Model | None = None,
    name: str | None = None,
    **estimator_kwargs,
) -> Handle:
    """Declare the advantage computation.

    Args:
        rollouts: ``rollouts`` handle from ``ops.generate``.
        rewards: ``rewards`` handle from ``ops.reward``.
        estimator: estimator name (``grpo``, ``dr_grpo``, ``rloo``, ``gae``, ...).
        critic: the value model for GAE (PPO); it is read, not updated, here.
        **estimator_kwargs: knobs of the estimator.
    """
    node = record(
        SPEC,
        {"rollouts": rollouts, "rewards": rewards},
        model=critic,
        attrs={"estimator": estimator, **estimator_kwargs},
        name=name,
    )
    return outputs(node, SPEC)
