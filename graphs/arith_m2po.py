"""M2PO on synthetic arithmetic (Zheng et al. 2025, "Prosperity before Collapse: How
Far Can Off-Policy RL Reach with Stale Data on LLMs?", arXiv:2510.01161): GRPO's
advantages trained on very stale samples, kept stable by a second-moment token mask.

1. ``dataset -> generate`` (``blocks.sample_groups``): a group of ``gen.n_samples``
   responses per arithmetic prompt, up to ``async.max_staleness`` versions old when
   trained (this job allows more staleness than the GRPO one).
2. ``reward``: 1 for an exactly right answer, else 0.
3. ``advantage``: group-relative, ``(r_i - mean_g) / (std_g + eps)`` (as GRPO).
4. ``train_step``: algorithm ``m2po``: the tokens with the largest
   ``(log pi_theta / pi_behav)^2`` are masked until the kept tokens' second moment
   ``M2 <= 0.04`` (``train.loss.m2po_threshold``); loss ``-M_t * rho_t * A_t`` with no clip.
5. ``sync_weights``: the new version goes to the generator.

Run: ``areal-flow run graphs/arith_m2po.py`` or ``python graphs/arith_m2po.py``.
"""

from areal_flow import Model, flow, ops
from areal_flow.blocks import sample_groups, train_policy


@flow
def arith_m2po(cfg):
    policy = Model("policy", cfg.model)
    rollout = sample_groups(policy, cfg)
    reward = ops.reward(rollout, fn="arithmetic")
    adv = ops.advantage(rollout, reward, estimator="grpo")
    return train_policy(policy, adv, rollout, cfg, algorithm="m2po")


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_m2po))
