"""``ops.advantage``: turn rewards (and critic values) into per-token advantages.

Port schema: inputs ``rollouts`` and ``rewards``; output ``advantages`` (the trajectories
with their advantages, what a ``train_step`` consumes). ``estimator`` names one of
``areal_flow.algorithms.advantages.ESTIMATORS``; extra keyword arguments go to it
(e.g. ``gamma``, ``lam``).

A node reads at most one model, and the runtime computes its outputs on the trainer
side, over the whole step batch (so batch-level statistics such as LitePPO's and
REINFORCE++'s std are over the step):

* ``critic=``: the value model; GAE uses its values ``V(s_t)`` ``[batch, seq]``, and its
  value targets (returns) train it in the critic's own ``train_step``.
* ``ref=``: a frozen reference policy (``Model(..., trainable=False)``, loaded from the
  initial policy); its log-probs give the per-token KL that REINFORCE++ folds into the
  reward (coefficient and estimator: ``train.loss.kl_coef`` / ``kl_estimator``).
"""

from __future__ import annotations

from areal_flow.algorithms.catalog import ESTIMATORS
from areal_flow.dsl import Handle, Model, outputs, record
from areal_flow.graph import GraphError, OpSpec, PortSpec

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
    ref: Model | None = None,
    name: str | None = None,
    **estimator_kwargs,
) -> Handle:
    """Declare the advantage computation.

    Args:
        rollouts: ``rollouts`` handle from ``ops.generate``.
        rewards: ``rewards`` handle from ``ops.reward``.
        estimator: estimator name (``grpo``, ``dr_grpo``, ``rloo``, ``gae``, ...).
        critic: the value model for GAE (PPO); it is read, not updated, here.
        ref: the frozen reference policy whose KL is folded into the reward (REINFORCE++).
        **estimator_kwargs: knobs of the estimator.

    Raises:
        GraphError: both ``critic`` and ``ref``, a ``ref`` declared trainable, or an
            unknown estimator (naming the node and line).
    """
    node = record(
        SPEC,
        {"rollouts": rollouts, "rewards": rewards},
        model=critic or ref,
        attrs={"estimator": estimator, **estimator_kwargs},
        name=name,
    )
    if critic is not None and ref is not None:
        raise GraphError(f"{node.where()}: an advantage node reads one model: pass critic= or ref=, not both")
    if ref is not None and ref.trainable:
        raise GraphError(f"{node.where()}: ref model '{ref.name}' must be declared Model(..., trainable=False)")
    if ref is not None:
        node.attrs["model_role"] = "ref"
    elif critic is not None:
        node.attrs["model_role"] = "critic"
    if estimator not in ESTIMATORS:
        raise GraphError(f"{node.where()}: unknown advantage estimator {estimator!r}; known: {', '.join(ESTIMATORS)}")
    return outputs(node, SPEC)
