"""PPO with a critic on synthetic arithmetic (Schulman et al. 2017; the LLM setting of
Ouyang et al. 2022): the one graph here with a learned baseline instead of a group one.

1. ``dataset -> generate`` (``blocks.sample_groups``): arithmetic prompts; the policy
   samples responses with per-token behavior log-probs and versions.
2. ``reward``: 1 for an exactly right answer, else 0, credited to the last response token.
3. ``advantage`` with the **critic**: values ``V_t = V(state before token t)`` from the
   value model (the policy's backbone + a scalar head, ``areal_flow.models.critic``), then
   GAE (Schulman et al. 2016, eq. 16):
   ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = sum_l (gamma * lam)^l delta_{t+l}``;
   value targets ``R_t = A_t + V_t``.
4. ``train_step(policy)``: PPO clipped surrogate (Schulman et al. 2017, eq. 7)
   ``-min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)``, token-mean.
5. ``train_step(critic)``: clipped value loss
   ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)``
   (``train.loss.value_clip_eps``), in the same optimizer step as the policy.
6. ``sync_weights``: the policy's new version goes back to the generator (the critic is
   used only by the trainer, so it is never synced).

Run: ``areal-flow run graphs/arith_ppo.py`` or ``python graphs/arith_ppo.py``
(knobs in ``graphs/arith_ppo.yaml``: ``advantage.gamma``, ``advantage.lam``, ``train.loss.*``).
"""

from areal_flow import Model, flow, ops
from areal_flow.blocks import sample_groups, train_policy


@flow
def arith_ppo(cfg):
    policy = Model("policy", cfg.model)
    critic = Model("critic", cfg.model)  # value model initialised from the policy's folder
    rollout = sample_groups(policy, cfg)
    reward = ops.reward(rollout, fn="arithmetic")
    adv = ops.advantage(rollout, reward, estimator="gae", critic=critic, gamma=cfg.advantage.gamma, lam=cfg.advantage.lam)
    stats = train_policy(policy, adv, rollout, cfg, algorithm="ppo")
    ops.train_step(critic, adv, algorithm="ppo", max_staleness=cfg.async_.max_staleness, name="critic_step")
    return stats


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_ppo))
