"""GRPO on counting with long-tailed answer lengths: the job where asynchrony pays.

The same algorithm as ``graphs/arith_grpo.py`` (Shao et al. 2024, DeepSeekMath §4.1) on a
task whose responses are mostly short with a few very long ones (``"17:21="`` ->
``"18 19 20 21"``; 3 to 192 tokens, Zipf-distributed, ``areal_flow.tasks.longtail``), the
shape of response lengths in reasoning RL. A synchronous step waits for its longest
response while the generator's batch empties; with ``async.max_staleness >= 1`` the
generator keeps its batch full with the next steps' prompts
(``bench/async_vs_sync.py --task longtail`` measures both).

1. ``dataset``: seeded counting problems with a Zipf-distributed count.
2. ``generate``: a group of ``n_samples`` responses per prompt, with per-token behavior
   log-probs and policy versions.
3. ``reward``: 1 for the exact sequence (stopped at the right number), else 0.
4. ``advantage``: group-relative, (r - mean(group)) / (std(group) + eps) on every token.
5. ``train_step``: PPO-clipped policy loss, AdamW; samples at most ``async.max_staleness``
   versions old.
6. ``sync_weights``: the new version goes to the generator (``gen.interruptible``: paused
   and resumed mid-sequence, or loaded once in-flight sequences finish).

Run: ``areal-flow run graphs/longtail_grpo.py`` (knobs in ``graphs/longtail_grpo.yaml``).
"""

from areal_flow import Model, flow, ops


@flow
def longtail_grpo(cfg):
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
    reward = ops.reward(rollout, fn="longtail")
    adv = ops.advantage(rollout, reward)  # the estimator of train.algorithm (GRPO's: group-relative)
    stats = ops.train_step(policy, adv, algorithm=cfg.train.algorithm, max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(longtail_grpo))
