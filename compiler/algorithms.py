"""Each train_step's algorithm, lowered into the plan: its whole loss config, the off-policy
correction for stale samples, and the user code a worker needs to run it.

Owns the one place where a loss config is computed (compile time): every train_step gets
``attrs["loss"]``, the whole ``LossConfig`` of its algorithm's defaults and ``train.loss``
(as a dict); the train_step, critic, rank and advantage executors read it from the plan and
rebuild nothing. With ``k >= 1`` a policy's samples may be up to ``k`` versions old, so the
decoupled PPO loss (Fu et al. 2025, AReaL eq. 5: the clip against the proximal
policy, times the capped behavior importance weight) is on by default, as in AReaL, for
every algorithm whose policy loss is the PPO clip; when it stays off (``train.loss`` says
so, the algorithm says so, or the policy loss is GSPO/SAPO/M2PO, which take their ratio
their own way) the compiler says so in one line of the plan's warnings. A critic's
train_step keeps the merged config (its value clip and aggregation) without the correction.
User-registered algorithms and estimators travel by value (``plan.algorithms``,
``plan.estimators``), like user ops (``plan.ops``). It imports no torch.
"""

from __future__ import annotations

import dataclasses

from areal_flow.algorithms.catalog import ESTIMATORS, algorithm_info, user_algorithm, user_estimator
from areal_flow.config_compile import CompileConfigError
from compiler.plan import encode_value
from compiler.workload import scalar_head_models

DECOUPLED = "use_decoupled_loss"


def lower_losses(graph, overrides: dict) -> tuple[str, ...]:
    """Set every train_step's ``attrs["loss"]`` (module doc); return the compiler's lines
    about an off-policy correction left off.

    Raises:
        CompileConfigError: ``train.loss`` that the node's algorithm cannot take (a policy
            loss it does not use, a value out of range), naming the node.
    """
    notes = []
    critics = set(scalar_head_models(graph))
    for node in (n for n in graph.trainers() if "algorithm" in n.attrs):  # train_step or a user trainer taking one
        info = algorithm_info(node.attrs["algorithm"])
        try:
            loss = info.loss_config(dict(overrides))
        except ValueError as err:
            raise CompileConfigError(f"train.loss for {node.where()}: {err}") from None
        k = next((e.max_staleness for e in graph.in_edges(node.name) if e.kind == "data"), None) or 0
        if node.model not in critics and k >= 1:
            loss, note = _off_policy(node, info, loss, overrides, k)
            notes.extend([note] if note else [])
        node.attrs["loss"] = dataclasses.asdict(loss)
    return tuple(notes)


GROUP_BASELINE = ("grpo", "dr_grpo", "rloo", "lite_ppo", "reinforce_pp_baseline")
"""Built-in estimators whose baseline is the mean of the sample's prompt group (Shao et al.
2024, GRPO eq. 3; Ahmadian et al. 2024, RLOO eq. 4): with one sample a prompt, every
advantage is 0 (or undefined), so nothing is learned."""


def group_notes(graph) -> tuple[str, ...]:
    """One line per advantage node with a group baseline (:data:`GROUP_BASELINE`) fed by a
    generator that samples one response a prompt (``n_samples=1``)."""
    notes = []
    for node in graph.nodes.values():
        if node.attrs.get("estimator") not in GROUP_BASELINE:
            continue
        gen = graph.source_of(node.name, "rollouts", "generate") or graph.source_of(node.name, "rollouts", "rollout")
        if gen is not None and gen.attrs.get("n_samples") == 1:
            notes.append(f"{node.where()}: estimator '{node.attrs['estimator']}' subtracts the mean of each prompt's "
                         f"group, but '{gen.name}' samples n_samples=1 a prompt: every advantage is 0 and the policy "
                         "does not learn; raise gen.n_samples (4-16 is usual)")
    return tuple(notes)


def _off_policy(node, info, loss, overrides: dict, k: int):
    """``(loss, note)``: the decoupled loss on for a PPO-clip policy unless ``train.loss`` or
    the algorithm set it; a note when it stays off."""
    stale = f"{node.where()} trains samples up to k={k} versions old"
    if DECOUPLED in overrides or DECOUPLED in info.loss_defaults:
        if loss.use_decoupled_loss:
            return loss, None
        who = "train.loss" if DECOUPLED in overrides else f"algorithm '{info.name}'"
        return loss, (f"{stale} with no off-policy correction: {who} sets {DECOUPLED}=false (the PPO ratio is "
                      "taken against the behavior policy)")
    if loss.policy_loss == "ppo":
        return dataclasses.replace(loss, **{DECOUPLED: True}), None
    return loss, (f"{stale} without the decoupled PPO loss: its policy loss '{loss.policy_loss}' takes the ratio "
                  f"its own way; train.loss.{DECOUPLED}=true adds the capped behavior importance weight")


def user_code(graph) -> tuple[dict, dict]:
    """``(algorithms, estimators)``: the user-registered ones the graph's nodes name, encoded
    (``compiler.plan.encode_value``) for ``plan.algorithms`` / ``plan.estimators``."""
    algorithms, estimators = {}, {}
    for node in graph.nodes.values():
        if node in graph.trainers() and "algorithm" in node.attrs:
            cls = user_algorithm(node.attrs["algorithm"])
            if cls is not None:
                algorithms[cls.name] = encode_value(cls)
        elif node.op == "advantage" and node.attrs.get("estimator") not in ESTIMATORS:
            name = node.attrs.get("estimator")
            estimators[name] = encode_value(user_estimator(name))
    return algorithms, estimators
