"""The RL rules of graph validation: what the runtime would otherwise refuse only after
its warm start.

Owns two groups of checks, run by :meth:`areal_flow.graph.Graph.validate` after the
structural ones (ports, producers, cycles), so every node and edge here is known to exist:

* **training** (:func:`training_defects`): each trainer's algorithm (``train_step`` or a
  user op that trains) against the ``advantage`` node that feeds it (directly or through user
  ops), using the torch-free ``algorithms.catalog`` (an advantage node that named no
  estimator got its train_step's algorithm's default when that train_step was traced:
  ``ops.advantage.settle_estimator``):

  - an algorithm that requires a critic (PPO) needs an advantage node with ``critic=``;
  - an algorithm that folds the KL to a reference policy into the reward (REINFORCE++)
    needs ``ref=`` and an estimator that takes the KL (otherwise the KL would be
    silently dropped);
  - an advantage node that names no estimator needs a train_step to take it from;
  - an estimator that reads critic values (GAE) needs ``critic=``;
  - a critic is trained on value targets, so with ``critic=`` the estimator must give
    returns (GAE, REINFORCE++, multi-turn);
  - a replay node (``ops.replay``) needs its train_step's ``max_staleness`` k >= 1 (with k = 0
    every buffered row is evicted before it could be replayed);
  - algorithm and estimator are one choice: an estimator that is another algorithm's
    default (``grpo`` under ``train.algorithm=rloo``) means the graph was written for that
    algorithm, and is refused naming both nodes and values. An estimator that is no
    algorithm's default (``multi_turn``, ``reinforce_pp_baseline``, a user's) goes with any.

* **weight channel** (:func:`weight_channel_defects`): a ``generate`` node that samples
  from a model some trainer updates must receive its weights (one
  ``sync_weights``, else it samples with the initial weights forever and the staleness
  bound stalls admission), and from exactly one route.

Each function yields one message per defect, naming the node and the graph file's
line (``Node.where()``); the graph raises the first as a ``GraphError``. This module
must not import torch nor know how or where nodes run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from areal_flow.algorithms.catalog import algorithm_info, algorithms_defaulting_to, estimator_info, estimator_names

if TYPE_CHECKING:
    from areal_flow.graph import Graph


def _estimators_that(flag: str) -> str:
    return ", ".join(name for name in estimator_names() if getattr(estimator_info(name), flag))


def training_defects(graph: Graph) -> Iterator[str]:
    """Messages for every algorithm/estimator/critic/ref mismatch (see the module docstring)."""
    pairs = [(step, algorithm_info(step.attrs.get("algorithm")), graph.source_of(step.name, "advantages", "advantage"))
             for step in graph.trainers()]
    pairs = [(step, algorithm, adv) for step, algorithm, adv in pairs if algorithm is not None and adv is not None]
    for step, algorithm, adv in pairs:  # unknown algorithms are refused while tracing
        estimator = estimator_info(adv.attrs.get("estimator") or "")
        role = adv.attrs.get("model_role")
        if algorithm.requires_critic and role != "critic":
            yield (f"{step.where()}: algorithm '{algorithm.name}' needs a critic, but {adv.where()} reads none; "
                   f"pass ops.advantage(..., estimator='{algorithm.default_estimator}', critic=Model('critic', ...))")
        if algorithm.kl_in_reward and role != "ref":
            yield (f"{step.where()}: algorithm '{algorithm.name}' folds the KL to a reference policy into the "
                   f"reward, but {adv.where()} reads none; pass ref=Model('ref', ..., trainable=False)")
        elif algorithm.kl_in_reward and estimator is not None and not estimator.takes_kl:
            yield (f"{step.where()}: algorithm '{algorithm.name}' folds the KL into the reward, but the estimator "
                   f"'{estimator.name}' of {adv.where()} takes no KL; use one of {_estimators_that('takes_kl')}")
    for adv in graph.nodes_of("advantage"):
        if adv.attrs.get("estimator") is None:
            yield (f"{adv.where()}: no estimator given and no train_step reads this node to take its algorithm's; "
                   "pass estimator=")
            continue
        estimator = estimator_info(adv.attrs["estimator"])
        if estimator is None:
            continue  # an unknown estimator is refused while tracing
        has_critic = adv.attrs.get("model_role") == "critic"
        if estimator.needs_values and not has_critic:
            yield (f"{adv.where()}: estimator '{estimator.name}' needs the values V(s_t) of a critic: "
                   "pass critic=Model('critic', ...)")
        if has_critic and not estimator.gives_returns:
            yield (f"{adv.where()}: critic '{adv.model}' is trained on value targets, but estimator "
                   f"'{estimator.name}' gives no returns; use one of {_estimators_that('gives_returns')}, or "
                   "drop critic=")
    for step in graph.trainers():
        replay = graph.source_of(step.name, "advantages", "replay")
        k = next((e.max_staleness for e in graph.in_edges(step.name) if e.kind == "data"), None)
        if replay is not None and not k:
            yield (f"{replay.where()}: it replays earlier steps' rows into {step.where()}, whose max_staleness=0 "
                   "evicts every one of them (a row trained at step s is >= 1 version old at s + 1); give the "
                   "train_step max_staleness >= 1 or drop the replay node")
    for step, algorithm, adv in pairs:
        given, default = adv.attrs.get("estimator"), algorithm.default_estimator
        owners = algorithms_defaulting_to(given) if given else []
        if given != default and owners:
            yield (f"{adv.where()} says estimator='{given}' (the estimator of {', '.join(owners)}), but "
                   f"{step.where()} trains algorithm='{algorithm.name}', whose estimator is '{default}': leave "
                   "estimator= out (the algorithm decides) or train the algorithm it belongs to")


def weight_channel_defects(graph: Graph) -> Iterator[str]:
    """Messages for a trained model's generator without weights, or with two weight routes."""
    writers = {n.model: n for n in graph.trainers()}
    for gen in graph.generators():
        routes = [e for e in graph.in_edges(gen.name) if e.dst_port == "weights"]
        step = writers.get(gen.model)
        if step is not None and not routes:
            yield (f"{step.where()}: it updates model '{gen.model}', but no ops.sync_weights({gen.model}, to=...) "
                   f"sends the new weights to {gen.where()}, which would sample with the initial weights forever; "
                   "add it after the train_step")
        if len(routes) > 1:
            first, second = (graph.nodes[e.src] for e in routes[:2])
            yield (f"{second.where()}: {gen.where()} already receives weights from {first.where()}; "
                   "one sync_weights per generator")
