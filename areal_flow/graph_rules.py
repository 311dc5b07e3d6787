"""The RL rules of graph validation: what the runtime would otherwise refuse only after
its warm start.

Owns two groups of checks, run by :meth:`areal_flow.graph.Graph.validate` after the
structural ones (ports, producers, cycles), so every node and edge here is known to exist:

* **training** (:func:`training_defects`): each trainer's algorithm (``train_step`` or a
  user op that trains) against the ``advantage`` node that feeds it, using the torch-free ``algorithms.catalog``:

  - an algorithm that requires a critic (PPO) needs an advantage node with ``critic=``;
  - an estimator that reads critic values (GAE) needs ``critic=``;
  - a critic is trained on value targets, so with ``critic=`` the estimator must give
    returns (GAE, REINFORCE++, multi-turn);
  - an algorithm that folds the KL to a reference policy into the reward (REINFORCE++)
    needs ``ref=`` and an estimator that takes the KL (otherwise the KL would be
    silently dropped).

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

from areal_flow.algorithms.catalog import ESTIMATORS, algorithm_info

if TYPE_CHECKING:
    from areal_flow.graph import Graph

_WITH_RETURNS = ", ".join(name for name, e in ESTIMATORS.items() if e.gives_returns)
_WITH_KL = ", ".join(name for name, e in ESTIMATORS.items() if e.takes_kl)


def training_defects(graph: Graph) -> Iterator[str]:
    """Messages for every algorithm/estimator/critic/ref mismatch (see the module docstring)."""
    for adv in graph.nodes_of("advantage"):
        estimator = ESTIMATORS.get(adv.attrs.get("estimator"))
        if estimator is None:
            continue  # an unknown estimator is refused while tracing
        has_critic = adv.attrs.get("model_role") == "critic"
        if estimator.needs_values and not has_critic:
            yield (f"{adv.where()}: estimator '{estimator.name}' needs the values V(s_t) of a critic: "
                   "pass critic=Model('critic', ...)")
        if has_critic and not estimator.gives_returns:
            yield (f"{adv.where()}: critic '{adv.model}' is trained on value targets, but estimator "
                   f"'{estimator.name}' gives no returns; use one of {_WITH_RETURNS}, or drop critic=")
    for step in graph.trainers():
        algorithm = algorithm_info(step.attrs.get("algorithm"))
        adv = graph.data_producer(step.name)
        if algorithm is None or adv is None or adv.op != "advantage":
            continue  # unknown algorithms are refused while tracing; a wrong producer by the edge check
        estimator = adv.attrs.get("estimator")
        role = adv.attrs.get("model_role")
        if algorithm.requires_critic and role != "critic":
            yield (f"{step.where()}: algorithm '{algorithm.name}' needs a critic, but {adv.where()} reads none; "
                   f"pass ops.advantage(..., estimator='{algorithm.default_estimator}', critic=Model('critic', ...))")
        if algorithm.kl_in_reward and role != "ref":
            yield (f"{step.where()}: algorithm '{algorithm.name}' folds the KL to a reference policy into the "
                   f"reward, but {adv.where()} reads none; pass ref=Model('ref', ..., trainable=False)")
        elif algorithm.kl_in_reward and estimator in ESTIMATORS and not ESTIMATORS[estimator].takes_kl:
            yield (f"{step.where()}: algorithm '{algorithm.name}' folds the KL into the reward, but the estimator "
                   f"'{estimator}' of {adv.where()} takes no KL; use one of {_WITH_KL}")


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
