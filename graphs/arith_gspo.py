"""GSPO on synthetic arithmetic (Zheng et al. 2025, "Group Sequence Policy
Optimization", eq. 5): GRPO's advantages with a sequence-level importance ratio.

1. ``dataset -> generate`` (``blocks.sample_groups``): a group of ``gen.n_samples``
   responses per arithmetic prompt.
2. ``reward``: 1 for an exactly right answer, else 0.
3. ``advantage``: group-relative, ``(r_i - mean_g) / (std_g + eps)`` (as GRPO).
4. ``train_step``: algorithm ``gspo``: one length-normalised ratio per response,
   ``s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|)``, clipped to
   ``[1 - 3e-4, 1 + 4e-4]`` (``train.loss.gspo_clip_eps_low/high``), loss
   ``-min(s_i A_i, clip(s_i) A_i)`` averaged per sequence (``seq-mean-token-mean``).
   Whole responses are kept or clipped, instead of single tokens.
5. ``sync_weights``: the new version goes to the generator.

Run: ``areal-flow run graphs/arith_gspo.py`` or ``python graphs/arith_gspo.py``.
"""

from areal_flow import Model, flow, ops
from areal_flow.blocks import sample_groups, train_policy


@flow
def arith_gspo(cfg):
    policy = Model("policy", cfg.model)
    rollout = sample_groups(policy, cfg)
    reward = ops.reward(rollout, fn="arithmetic")
    adv = ops.advantage(rollout, reward, estimator="grpo")
    return train_policy(policy, adv, rollout, cfg, algorithm="gspo")


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_gspo))
