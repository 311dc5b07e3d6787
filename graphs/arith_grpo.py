"""GRPO on synthetic arithmetic with a tiny model: the embedded default job.

Read top to bottom, this is the whole algorithm (Shao et al. 2024, DeepSeekMath §4.1):

1. ``dataset``: seeded arithmetic problems ("37+58=" -> "95").
2. ``generate``: the policy samples a group of ``n_samples`` answers per prompt, recording
   per-token behavior log-probs and the policy version of every token.
3. ``reward``: 1 for an exactly right answer, else 0.
4. ``advantage``: group-relative: (r - mean(group)) / (std(group) + eps), every token of a
   response gets its sequence's advantage (the estimator of ``train.algorithm``: with
   ``train.algorithm=rloo`` the leave-one-out baseline instead).
5. ``train_step``: PPO-clipped policy loss, token-mean over the whole optimizer step, AdamW;
   samples arrive at most ``async.max_staleness`` versions old (bounded-staleness edge).
6. ``sync_weights``: the new version goes to the generator on the weight channel; in-flight
   generations are paused, reloaded and resumed, not discarded.

Run: ``areal-flow run graphs/arith_grpo.py`` or ``python graphs/arith_grpo.py``
(knobs in ``graphs/arith_grpo.yaml``; override any with ``key=value``).
"""

from areal_flow import Model, flow, ops


@flow
def arith_grpo(cfg):
    policy = Model("policy", cfg.model)
    prompts = ops.dataset(cfg.dataset)
    rollout = ops.generate(
        policy,
        prompts,
        n_samples=cfg.gen.n_samples,
        max_new_tokens=cfg.gen.max_new_tokens,
        temperature=cfg.gen.temperature,
        top_p=cfg.gen.top_p,
        engine=cfg.gen.engine,  # "embedded" or "vllm"
    )
    reward = ops.reward(rollout, fn="arithmetic")
    adv = ops.advantage(rollout, reward)  # the estimator of train.algorithm (GRPO's: group-relative)
    stats = ops.train_step(policy, adv, algorithm=cfg.train.algorithm, max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_grpo))
