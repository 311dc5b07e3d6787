"""The ``advantage`` node's executor: the step's groups -> one collated batch with advantages.

Owns the batch-grain computation of ``areal_flow.ops.advantage`` (see its docstring for the
formulas): collate the ``B`` groups of the step (rewards from the node's ``rewards`` port, so
a user op between reward and advantage counts), the critic's values (GAE), the KL to a
reference folded into the reward (with the coefficient and estimator of the loss config the
plan gives the policy's train_step it feeds), and the estimator (built in, or registered from
``plan.estimators``) with the node's knobs: every attribute but its own (``gamma`` of
``multi_turn`` included, which the compiler lowers from the rollout node, ``compiler.program``).
It must not update any model.
"""

from __future__ import annotations

import torch

from areal_flow.algorithms.advantages import compute_advantages
from areal_flow.algorithms.catalog import estimator_info
from areal_flow.algorithms.config import LossConfig
from areal_flow.algorithms.kl import kl_penalty
from areal_flow.models.logprobs import token_logprobs
from areal_flow.batching import collate
from areal_flow.values import Advantages

_OWN = ("estimator", "kl_coef", "model_role")
_CHUNK = 64  # sequences per no-grad forward (values, reference log-probs)


def _no_grad_rows(model: torch.nn.Module, fn, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """``fn(ids, attn) -> [rows, T]`` over chunks of rows, on ``model``'s device; ``[N, T]`` float32 on CPU."""
    device = next(model.parameters()).device
    out = torch.zeros(ids.shape, dtype=torch.float32)
    with torch.no_grad():
        for start in range(0, ids.shape[0], _CHUNK):
            sl = slice(start, start + _CHUNK)
            out[sl] = fn(ids[sl].to(device), attn[sl].to(device)).float().cpu()
    return out


class AdvantageExecutor:
    """Grain ``batch``: the step's ``rollouts`` (and ``rewards``, ``ref_logprobs``: lists of
    per-group values) -> ``{"advantages": areal_flow.values.Advantages}``.

    Its ``batch`` holds the tensors of ``areal_flow.batching.collate`` (``[B*n, T]``) plus
    ``advantages`` and, as available, ``values``/``returns`` (critic) and
    ``ref_logprobs``; its ``stats`` hold ``kl_ref_in_reward`` (nats per token) when a KL was
    folded into the reward.
    """

    def __init__(self, node, ctx) -> None:
        self.node, self.ctx = node, ctx
        self.estimator = node.attrs["estimator"]
        self.kwargs = {k: v for k, v in node.attrs.items() if k not in _OWN}
        role = node.attrs.get("model_role")
        self.critic = ctx.model(node.model) if role == "critic" else None
        self.ref = ctx.model(node.model) if role == "ref" else None
        self.takes_kl = estimator_info(self.estimator).takes_kl
        gen = ctx.generator()
        self.temperature = gen.attrs.get("temperature") or 1.0
        consumer = next((n for n in ctx.plan.nodes if n.trains and any(src == node.name for src, _ in n.inputs.values())
                         and ctx.plan.models[n.model]["head"] == "lm"), None)  # the policy's trainer it feeds
        loss = None if consumer is None else consumer.attrs.get("loss")  # a user trainer may declare none
        self.loss_cfg = None if loss is None else LossConfig(**loss)  # the plan's, whole

    def _reference(self, inputs: dict, trajectories, batch) -> tuple[torch.Tensor | None, float, str]:
        """``(ref_logprobs [B, T] or None, kl_coef, kl estimator)``."""
        if "ref_logprobs" in inputs:
            ref = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
            rows = [lp for group in inputs["ref_logprobs"] for lp in group]
            for row, (t, lp) in enumerate(zip(trajectories, rows)):
                p = len(t.prompt_ids)
                ref[row, p:p + len(lp)] = torch.tensor(lp, dtype=torch.float32)
            return ref, float(self.node.attrs.get("kl_coef", 0.0)), "k1"
        if self.ref is not None:
            def forward(ids, attn):
                return token_logprobs(self.ref, ids, attn, temperature=self.temperature)

            ref = _no_grad_rows(self.ref, forward, batch["input_ids"], batch["attention_mask"])
            cfg = self.loss_cfg
            coef = cfg.kl_coef if cfg is not None and cfg.kl_in_reward else 0.0
            return ref, coef, cfg.kl_estimator if cfg is not None else "k1"
        return None, 0.0, "k1"

    def run(self, inputs: dict, info: dict) -> dict:
        """Raises ValueError: a critic with an estimator that gives no returns."""
        trajectories = [t for group in inputs["rollouts"] for t in group]
        if "rewards" in inputs:  # else a rollout node scored its episodes (their discounted returns)
            for t, r in zip(trajectories, (r for group in inputs["rewards"] for r in group)):
                t.reward = float(r)
        batch = collate(trajectories, self.ctx.pad_id)
        mask = batch["loss_mask"]
        args = dict(rewards=batch["rewards"], group_ids=batch["group_ids"], loss_mask=mask)
        if "turn_ids" in batch:
            args.update(turn_ids=batch["turn_ids"], turn_rewards=batch["turn_rewards"])
        stats: dict[str, float] = {}
        ref, coef, estimator = self._reference(inputs, trajectories, batch)
        if ref is not None:
            batch["ref_logprobs"] = ref
        if ref is not None and coef > 0:
            kl = kl_penalty(batch["behavior_logprobs"], ref, estimator, loss_mask=mask)
            stats["kl_ref_in_reward"] = float(kl.sum() / mask.sum().clamp(min=1))
            if self.takes_kl:
                args.update(kl=kl, kl_coef=coef)
            else:  # sequence-level penalty: R = r - beta * sum_t KL_t (Ouyang et al. 2022, eq. 2)
                args["rewards"] = batch["rewards"] - coef * (kl * mask).sum(1)
        if self.critic is not None:
            def values(ids, attn):
                return self.critic(input_ids=ids, attention_mask=attn)

            batch["values"] = args["values"] = _no_grad_rows(self.critic, values, batch["input_ids"], batch["attention_mask"])
        out = compute_advantages(self.estimator, **args, **self.kwargs)
        batch["advantages"] = out.advantages
        if out.returns is not None:
            batch["returns"] = out.returns
        elif self.critic is not None:
            raise ValueError(f"{self.node.where()}: estimator {self.estimator!r} gives no returns to train the critic "
                             "on (use 'gae')")
        return {"advantages": Advantages(batch, trajectories, stats)}
