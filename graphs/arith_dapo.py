"""DAPO on synthetic arithmetic (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale"): GRPO plus four techniques, two on the data side (the reward
node, on the generator) and two in the loss.

1. ``dataset -> generate`` (``blocks.sample_groups``): a group of ``gen.n_samples``
   responses per arithmetic prompt.
2. ``reward``: 1 for an exactly right answer, else 0, plus
   - overlong reward shaping (§3.4, eq. 13) with ``L_max = gen.max_new_tokens`` and
     ``L_cache = reward.overlong_cache``: 0 up to ``L_max - L_cache`` tokens, then a linear
     penalty down to -1 at ``L_max`` (the section's other option, overlong filtering, is
     ``train.loss.mask_truncated: true``: no loss for a cut response);
   - dynamic sampling (§3.2, the constraint ``0 < |{o_i correct}| < G`` of DAPO's objective): a
     group whose rewards are all equal has zero advantage, so it is dropped and its batch
     slot gets a new prompt, at most ``reward.max_attempts`` prompts per slot (then the
     run stops with a clear error instead of spinning).
3. ``advantage``: group-relative, ``(r_i - mean_g) / (std_g + eps)`` (as GRPO).
4. ``train_step``: algorithm ``dapo``: PPO surrogate with clip-higher (§3.1,
   ``eps_low = 0.2``, ``eps_high = 0.28``) and the token-level loss (§3.3: every token of
   the step weighs the same, ``token-mean``); no KL term.
5. ``sync_weights``: the new version goes to the generator.

Run: ``areal-flow run graphs/arith_dapo.py`` or ``python graphs/arith_dapo.py``
(knobs in ``graphs/arith_dapo.yaml``: ``reward.*``, ``train.loss.clip_eps_high``).
"""

from areal_flow import Model, flow, ops
from areal_flow.blocks import sample_groups, train_policy


@flow
def arith_dapo(cfg):
    policy = Model("policy", cfg.model)
    rollout = sample_groups(policy, cfg)
    reward = ops.reward(
        rollout,
        fn="arithmetic",
        overlong=(cfg.gen.max_new_tokens, cfg.reward.overlong_cache),  # L_max, L_cache (eq. 13)
    )
    # dynamic sampling (§3.2): drop all-equal groups; the router gives the slot a new prompt
    kept = ops.filter(rollout, reward, keep="informative", max_attempts=cfg.reward.max_attempts)
    adv = ops.advantage(kept, reward, estimator="grpo")
    return train_policy(policy, adv, rollout, cfg, algorithm="dapo")


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_dapo))
