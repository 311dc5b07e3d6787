"""LitePPO on synthetic arithmetic (Liu et al. 2025, "Part I: Tricks or Traps? A Deep
Dive into RL for LLM Reasoning", arXiv:2508.08221): two tricks on a plain critic-free PPO.

1. ``dataset -> generate`` (``blocks.sample_groups``): a group of ``gen.n_samples``
   responses per arithmetic prompt.
2. ``reward``: 1 for an exactly right answer, else 0.
3. ``advantage``: group-level mean, *batch*-level std:
   ``A_i = (r_i - mean_g(r)) / (std_batch(r) + eps)``, the std over every reward of the
   step batch (the trainer computes advantages on the whole batch), which stays robust
   when a group's rewards are nearly all equal.
4. ``train_step``: algorithm ``lite_ppo``: PPO clipped surrogate with token-level loss
   aggregation (``token-mean``).
5. ``sync_weights``: the new version goes to the generator.

Run: ``areal-flow run graphs/arith_lite_ppo.py`` or ``python graphs/arith_lite_ppo.py``.
"""

from areal_flow import Model, flow, ops
from areal_flow.blocks import sample_groups, train_policy


@flow
def arith_lite_ppo(cfg):
    policy = Model("policy", cfg.model)
    rollout = sample_groups(policy, cfg)
    reward = ops.reward(rollout, fn="arithmetic")
    adv = ops.advantage(rollout, reward, estimator="lite_ppo")
    return train_policy(policy, adv, rollout, cfg, algorithm="lite_ppo")


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_lite_ppo))
