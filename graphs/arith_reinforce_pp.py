"""REINFORCE++ on synthetic arithmetic (Hu 2025, "REINFORCE++: A Simple and Efficient
Approach for Aligning Large Language Models", arXiv:2501.03262, §3): no critic, no group
baseline; the KL to a frozen reference policy is part of the token reward and the
returns are normalised over the whole batch.

1. ``dataset -> generate`` (``blocks.sample_groups``): responses to arithmetic prompts.
2. ``reward``: 1 for an exactly right answer, else 0.
3. ``advantage`` with the **reference model** ``ref`` (the initial policy, frozen):
   per-token KL ``kl_t = log pi_behav(y_t) - log pi_ref(y_t)`` (k1, ``train.loss.kl_estimator``),
   token reward ``r_t = 1[t = last] * r - beta * kl_t`` (``beta = train.loss.kl_coef``),
   return ``G_t = sum_{s >= t} gamma^(s-t) r_s`` (``advantage.gamma``), advantage
   ``A_t = (G_t - mean(G)) / (std(G) + eps)`` with mean and std over every response token
   of the step batch (the trainer computes it on the whole batch).
4. ``train_step``: algorithm ``reinforce_pp``: PPO clipped surrogate, token-mean; the KL
   is already in the reward, so the loss has no KL term.
5. ``sync_weights``: the new version goes to the generator.

Run: ``areal-flow run graphs/arith_reinforce_pp.py`` or ``python graphs/arith_reinforce_pp.py``
(knobs in ``graphs/arith_reinforce_pp.yaml``).
"""

from areal_flow import Model, flow, ops
from areal_flow.blocks import sample_groups, train_policy


@flow
def arith_reinforce_pp(cfg):
    policy = Model("policy", cfg.model)
    ref = Model("ref", cfg.model, trainable=False)  # the initial policy, never updated
    rollout = sample_groups(policy, cfg)
    reward = ops.reward(rollout, fn="arithmetic")
    adv = ops.advantage(rollout, reward, estimator="reinforce_pp", ref=ref, gamma=cfg.advantage.gamma)
    return train_policy(policy, adv, rollout, cfg, algorithm="reinforce_pp")


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_reinforce_pp))
