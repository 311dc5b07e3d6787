"""GRPO with a reference-policy KL, a learned reward model and DAPO's group filter, on
synthetic arithmetic: the graph of a full RLHF-style pipeline, each part one node.

1. ``dataset -> generate``: arithmetic prompts; the policy samples ``gen.n_samples``
   responses per prompt (``gen.engine``: embedded or vllm) with per-token behavior
   log-probs and versions.
2. ``logprobs(ref)``: the frozen initial policy's log-probs of the same tokens — a
   forward-only model node (the compiler places it; by default with the trainer).
3. ``reward(model=rm)``: a reward model (``<preset>-rm``: the policy's backbone plus a
   scalar head, trained in code on right vs near-miss answers, cached) scores each
   response: ``sigmoid(score)`` in [0, 1]. At its default training (400 steps) it tells
   right from near-miss answers on held-out 2-digit problems only at chance level (about
   52 %, measured): this graph shows the pipeline; the rule-reward graphs are the ones
   that learn.
4. ``filter``: a group whose rewards are all equal has zero group-relative advantage; it
   is dropped and its batch slot gets a new prompt (Yu et al. 2025, DAPO §3.2).
5. ``advantage``: the sequence reward minus ``kl_coef * sum_t KL_t`` to the reference
   (Ouyang et al. 2022, eq. 2; KL_t = log pi_behav - log pi_ref), then GRPO's group
   normalisation (Shao et al. 2024, §4.1.2): ``A_i = (R_i - mean(R)) / std(R)``.
6. ``train_step``: GRPO's clipped surrogate on a bounded-staleness edge (``async.max_staleness``);
   ``sync_weights`` sends each new version to every generation replica.

Run: ``areal-flow run graphs/arith_grpo_ref_rm.py`` (knobs in the YAML beside it);
``compile.allocation="gen:d2 + train:d1" cluster.n_gpus_per_node=3`` for two replicas.
"""

from areal_flow import Model, flow, ops


@flow
def arith_grpo_ref_rm(cfg):
    policy = Model("policy", cfg.model)
    ref = Model("ref", cfg.model, trainable=False)
    rm = Model("rm", f"{cfg.model.path}-rm", trainable=False)
    prompts = ops.dataset(cfg.dataset)
    rollout = ops.generate(policy, prompts, n_samples=cfg.gen.n_samples, max_new_tokens=cfg.gen.max_new_tokens,
                           temperature=cfg.gen.temperature, top_p=cfg.gen.top_p, engine=cfg.gen.engine)
    ref_lp = ops.logprobs(ref, rollout, temperature=cfg.gen.temperature)
    score = ops.reward(rollout, model=rm)
    kept = ops.filter(rollout, score, keep="informative", max_attempts=cfg.reward.max_attempts)
    adv = ops.advantage(kept, score, estimator="grpo", ref_logprobs=ref_lp, kl_coef=cfg.advantage.kl_coef)
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_grpo_ref_rm))
