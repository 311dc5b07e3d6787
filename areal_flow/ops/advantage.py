"""``ops.advantage``: turn rewards (and critic values) into per-token advantages.

Port schema: inputs ``rollouts``, ``rewards`` and optionally ``ref_logprobs`` (from
``ops.logprobs`` of a frozen reference); output ``advantages`` (the step's collated batch
with its advantages: what a ``train_step`` consumes). ``estimator`` names a built-in
estimator (``areal_flow.algorithms.advantages.ESTIMATORS``) or one a graph registered
(``catalog.register_estimator``); extra keyword arguments go to it (e.g. ``gamma``, ``lam``).
Left out, it is the default estimator of the algorithm of the ``train_step`` this node feeds,
set while that node is traced (:func:`settle_estimator`), so ``train.algorithm=rloo`` gives
RLOO's advantages; an explicit estimator that is another algorithm's default is refused by the
graph's rules (``areal_flow.graph_rules``).

Grain ``batch``: the node runs once per train step over the step's ``B`` groups, so
batch-level statistics (LitePPO's and REINFORCE++'s std) are over the step. It reads at
most one model:

* ``critic=``: the value model; GAE uses its values ``V(s_t)`` ``[batch, seq]``, and its
  value targets (returns) train it in the critic's own ``train_step``.
* ``ref=``: a frozen reference policy whose log-probs give the per-token KL that
  REINFORCE++ folds into the token reward (``train.loss.kl_coef`` / ``kl_estimator`` of the
  train_step this node feeds, when its algorithm says ``kl_in_reward``).

With ``ref_logprobs=`` and ``kl_coef > 0`` the KL to the reference is folded into the
reward: per token (``-kl_coef * KL_t``) for an estimator that takes token KL
(REINFORCE++), else summed over the response into the sequence reward,
``R = r - kl_coef * sum_t KL_t`` (Ouyang et al. 2022, eq. 2), with ``KL_t`` the k1
estimate ``log pi_behav(y_t) - log pi_ref(y_t)`` (Schulman 2020, "Approximating KL
divergence"). The reference log-probs also travel in the batch (``ref_logprobs``) for a
KL term in the loss (``train.loss.kl_coef`` with ``kl_in_reward=false``).
"""

from __future__ import annotations

import inspect

from areal_flow.algorithms.catalog import AlgorithmInfo, estimator_info, estimator_names
from areal_flow.tracing import Handle, Model, current_graph, outputs, record
from areal_flow.graph import GraphError, Node, OpSpec, PortSpec
from areal_flow.ops.registry import BATCH, CPU, INFERENCE, OPS, OpDef, check_arguments, define

SPEC = OpSpec(
    "advantage",
    inputs=(PortSpec("rollouts", "rollouts"), PortSpec("rewards", "rewards", required=False),
            PortSpec("ref_logprobs", "logprobs", required=False)),
    outputs=(PortSpec("advantages", "advantages"),),
)
OP = define(OpDef(SPEC, BATCH, lambda node: INFERENCE if node.model else CPU,
                  "runtime.executors.advantage:AdvantageExecutor"))


def advantage(
    rollouts: Handle,
    rewards: Handle | None = None,
    *,
    estimator: str | None = None,
    critic: Model | None = None,
    ref: Model | None = None,
    ref_logprobs: Handle | None = None,
    kl_coef: float = 0.0,
    name: str | None = None,
    **estimator_kwargs,
) -> Handle:
    """Declare the advantage computation.

    Args:
        rollouts: ``rollouts`` handle from ``ops.generate`` (or ``ops.filter``).
        rewards: ``rewards`` handle from ``ops.reward`` (or a user op); None when the
            rollouts are episodes of ``ops.rollout`` (scored by their env: the discounted
            return of each episode; ``estimator="multi_turn"`` reads the turn rewards).
        estimator: estimator name (``grpo``, ``dr_grpo``, ``rloo``, ``gae``, ...); None = the
            default estimator of the consuming train_step's algorithm (module doc).
        critic: the value model for GAE (PPO); it is read, not updated, here.
        ref: the frozen reference policy whose KL is folded into the reward (REINFORCE++).
        ref_logprobs: ``logprobs`` handle of a reference model (``ops.logprobs``).
        kl_coef: beta, nats of reward per nat of KL to ``ref_logprobs`` (module doc).
        **estimator_kwargs: knobs of the estimator (``catalog.estimator_info(estimator).knobs``,
            e.g. ``gamma`` and ``lam`` for ``gae``).

    Raises:
        GraphError: both ``critic`` and ``ref``, a ``ref`` declared trainable, an unknown
            estimator, a keyword argument the estimator does not take (with a did-you-mean
            and its knobs), ``kl_coef`` without ``ref_logprobs``, no ``rewards`` for rollouts
            no env scored, or ``multi_turn`` on single-turn rollouts (naming the node and line).
    """
    node = record(
        SPEC,
        {"rollouts": rollouts, "rewards": rewards, "ref_logprobs": ref_logprobs},
        model=critic or ref,
        attrs={"estimator": estimator, "kl_coef": kl_coef, **estimator_kwargs},
        name=name,
    )
    if critic is not None and ref is not None:
        raise GraphError(f"{node.where()}: an advantage node reads one model: pass critic= or ref=, not both")
    if ref is not None and ref.trainable:
        raise GraphError(f"{node.where()}: ref model '{ref.name}' must be declared Model(..., trainable=False)")
    if kl_coef and ref_logprobs is None:
        raise GraphError(f"{node.where()}: kl_coef={kl_coef} needs ref_logprobs= (an ops.logprobs of the reference)")
    if ref is not None:
        node.attrs["model_role"] = "ref"
    elif critic is not None:
        node.attrs["model_role"] = "critic"
    if rewards is None and not _from_rollout(rollouts):
        raise GraphError(f"{node.where()}: no rewards= for rollouts that no env scored; pass ops.reward(...) "
                         "(or take the rollouts from ops.rollout)")
    if estimator is None:  # the train_step settles it; meanwhile a knob no estimator takes is a typo
        knobs = sorted({k for name in estimator_names() for k in estimator_info(name).knobs})
        check_arguments(node.where(), estimator_kwargs, knobs, taker="an estimator", nearby=_OWN_ARGUMENTS)
    else:
        _check_estimator(node, estimator, f"estimator '{estimator}'")
    return outputs(node, SPEC)


_OWN = ("estimator", "kl_coef", "model_role")
"""Attributes of an advantage node that are not estimator knobs."""

_OWN_ARGUMENTS = [p for p in inspect.signature(advantage).parameters if p != "estimator_kwargs"]
"""The op's own parameters: a did-you-mean for a misspelt one (``estimatr``)."""


def _check_estimator(node: Node, estimator: str, taker: str) -> None:
    """Raise GraphError (naming ``node``) for an unknown estimator, a knob it does not take, or
    ``multi_turn`` on rollouts that are not episodes."""
    info = estimator_info(estimator)
    if info is None:
        raise GraphError(f"{node.where()}: unknown advantage estimator {estimator!r}; known: "
                         f"{', '.join(estimator_names())}")
    if estimator == "multi_turn" and not _from_rollout(_rollouts_handle(node)):
        raise GraphError(f"{node.where()}: estimator 'multi_turn' needs the episodes of an ops.rollout (turn rewards)")
    knobs = [k for k in node.attrs if k not in _OWN]
    check_arguments(node.where(), knobs, info.knobs, taker=taker, nearby=_OWN_ARGUMENTS)


def settle_estimator(adv: Node, algorithm: AlgorithmInfo) -> None:
    """Give advantage node ``adv``, if it names no estimator, the default estimator of
    ``algorithm`` (the algorithm of the train_step it feeds, being traced), and check the
    node's knobs against it. An estimator ``adv`` names is checked against the algorithm
    by the graph's rules (``areal_flow.graph_rules``).

    Raises:
        GraphError: a knob the settled estimator does not take (naming ``adv`` and its line).
    """
    if adv.attrs.get("estimator") is None:
        default = algorithm.default_estimator
        adv.attrs["estimator"] = default
        _check_estimator(adv, default, f"estimator '{default}' (the default of algorithm '{algorithm.name}')")


def _rollouts_handle(node: Node) -> Handle:
    graph = current_graph()
    edge = next(e for e in graph.in_edges(node.name) if e.dst_port == "rollouts")
    return Handle(edge.src, edge.src_port, "rollouts")


def _from_rollout(handle: Handle) -> bool:
    """Whether ``handle``'s rollouts are multi-turn episodes (of an ``ops.rollout``, through
    filters/user ops)."""
    graph = current_graph()
    name = handle.node
    while name in graph.nodes:
        node = graph.nodes[name]
        if node.op in OPS and OPS[node.op].multi_turn:
            return True
        feeding = next((e for e in graph.in_edges(name) if e.dst_port == "rollouts"), None)
        if feeding is None:
            return False
        name = feeding.src
    return False
