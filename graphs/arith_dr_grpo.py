"""Dr.GRPO on synthetic arithmetic (Liu et al. 2025, "Understanding R1-Zero-Like
Training: A Critical Perspective", §3): GRPO without its two length and difficulty
biases.

1. ``dataset -> generate`` (``blocks.sample_groups``): a group of ``gen.n_samples``
   responses per arithmetic prompt.
2. ``reward``: 1 for an exactly right answer, else 0.
3. ``advantage``: ``A_i = r_i - mean_g(r)``: the group mean only, no division by the
   group std (which up-weights too-easy and too-hard questions).
4. ``train_step``: algorithm ``dr_grpo``: PPO clipped surrogate, per-token losses
   *summed* per response and divided by a constant (``seq-mean-token-sum-norm`` with
   ``train.loss.loss_agg_norm_length`` = the generation budget), not by each response's
   length (which favours long wrong answers).
5. ``sync_weights``: the new version goes to the generator.

Run: ``areal-flow run graphs/arith_dr_grpo.py`` or ``python graphs/arith_dr_grpo.py``.
"""

from areal_flow import Model, flow, ops
from areal_flow.blocks import sample_groups, train_policy


@flow
def arith_dr_grpo(cfg):
    policy = Model("policy", cfg.model)
    rollout = sample_groups(policy, cfg)
    reward = ops.reward(rollout, fn="arithmetic")
    adv = ops.advantage(rollout, reward, estimator="dr_grpo")
    return train_policy(policy, adv, rollout, cfg, algorithm="dr_grpo")


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_dr_grpo))
