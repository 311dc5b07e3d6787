"""RLOO on synthetic arithmetic (Ahmadian et al. 2024, "Back to Basics: Revisiting
REINFORCE Style Optimization for Learning from Human Feedback in LLMs", §3; the
leave-one-out baseline of Kool et al. 2019).

1. ``dataset -> generate`` (``blocks.sample_groups``): a group of ``n = gen.n_samples``
   responses per arithmetic prompt.
2. ``reward``: 1 for an exactly right answer, else 0.
3. ``advantage``: each sample's baseline is the mean reward of the *other* samples of
   its group, ``A_i = r_i - 1/(n-1) * sum_{j != i} r_j`` (unbiased: the baseline does not
   depend on the sample itself); no std normalisation.
4. ``train_step``: algorithm ``rloo``: PPO clipped surrogate (off-policy correction for
   the async staleness), token-mean.
5. ``sync_weights``: the new version goes to the generator.

Run: ``areal-flow run graphs/arith_rloo.py`` or ``python graphs/arith_rloo.py``.
"""

from areal_flow import Model, flow, ops
from areal_flow.blocks import sample_groups, train_policy


@flow
def arith_rloo(cfg):
    policy = Model("policy", cfg.model)
    rollout = sample_groups(policy, cfg)
    reward = ops.reward(rollout, fn="arithmetic")
    adv = ops.advantage(rollout, reward, estimator="rloo")
    return train_policy(policy, adv, rollout, cfg, algorithm="rloo")


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_rloo))
