"""A customer-service agent trained with multi-turn RL: the agentic example.

Read top to bottom, this is the whole algorithm:

1. ``dataset``: seeded support-desk scenarios (a customer with a hidden intent and an order).
2. ``rollout``: ``n_samples`` episodes per scenario against the ``support_desk`` env
   (``areal_flow/envs/support_desk.py``): the policy's turn on the generation engine, the
   env's step (a simulated customer, tool calls ``lookup``/``refund``/``escalate``/``end``),
   until the case is closed or ``env.max_turns`` turns. Customer and tool tokens sit in the
   trajectory, masked out of the loss; every policy token keeps the version that sampled it.
3. ``advantage``: the episode's discounted return ``G_0 = sum_k gamma^k R_k`` (a reward for
   resolving, a cost per turn, ``gamma = env.gamma``), group-relative over the
   ``n_samples`` episodes of a scenario (GRPO, Shao et al. 2024, §4.1.2, over whole episodes).
4. ``train_step``: PPO-clipped policy loss on the policy's tokens only, averaged per episode
   (``train.loss.loss_agg_mode``) so long failed episodes do not outweigh short ones; samples
   arrive at most ``async.max_staleness`` versions old.
5. ``sync_weights``: new versions reach the generator between engine steps, so a weight
   update can land between two turns of one episode.

Run: ``areal-flow run graphs/agent_support.py`` (knobs in ``graphs/agent_support.yaml``).
The held-out resolution rate and mean turns, before and after RL, are printed at the end;
measured results (three seeds, one evaluation each: resolution up by 6-13 points, mean
turns down by 0.12-0.38; pooled with re-evaluations in docs/AGENTS.md).
"""

from areal_flow import Model, flow, ops


@flow
def agent_support(cfg):
    policy = Model("policy", cfg.model)
    scenarios = ops.dataset(cfg.dataset)
    episodes = ops.rollout(
        policy,
        scenarios,
        env=cfg.env.name,  # "support_desk"
        max_turns=cfg.env.max_turns,
        gamma=cfg.env.gamma,
        step_timeout_s=cfg.env.step_timeout_s,
        env_config=cfg.env.config,  # e.g. turn_cost
        n_samples=cfg.gen.n_samples,
        max_new_tokens=cfg.gen.max_new_tokens,  # per policy turn
        temperature=cfg.gen.temperature,
    )
    adv = ops.advantage(episodes)  # train.algorithm's estimator over the episodes' discounted returns
    stats = ops.train_step(policy, adv, algorithm=cfg.train.algorithm, max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=episodes)
    return stats


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(agent_support))
