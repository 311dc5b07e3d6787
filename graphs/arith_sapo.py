"""SAPO on synthetic arithmetic (Gao et al. 2025, "Soft Adaptive Policy Optimization",
arXiv:2511.20347): GRPO's advantages with a soft gate in place of the hard clip.

1. ``dataset -> generate`` (``blocks.sample_groups``): a group of ``gen.n_samples``
   responses per arithmetic prompt.
2. ``reward``: 1 for an exactly right answer, else 0.
3. ``advantage``: group-relative, ``(r_i - mean_g) / (std_g + eps)`` (as GRPO).
4. ``train_step``: algorithm ``sapo``: ``L_t = -(4 / tau) * sigmoid(tau * (rho_t - 1)) * A_t``
   with ``tau = 1.0`` for positive and ``1.05`` for negative advantages
   (``train.loss.sapo_tau_pos/neg``): the plain policy gradient at ``rho = 1``, fading
   smoothly as the ratio drifts, with no token cut off abruptly.
5. ``sync_weights``: the new version goes to the generator.

Run: ``areal-flow run graphs/arith_sapo.py`` or ``python graphs/arith_sapo.py``.
"""

from areal_flow import Model, flow, ops
from areal_flow.blocks import sample_groups, train_policy


@flow
def arith_sapo(cfg):
    policy = Model("policy", cfg.model)
    rollout = sample_groups(policy, cfg)
    reward = ops.reward(rollout, fn="arithmetic")
    adv = ops.advantage(rollout, reward, estimator="grpo")
    return train_policy(policy, adv, rollout, cfg, algorithm="sapo")


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_sapo))
