"""GRPO on synthetic arithmetic scored by a second, frozen generating model: an LLM judge.

1. ``dataset -> generate``: arithmetic prompts; the policy samples ``gen.n_samples``
   responses per prompt (behavior log-probs and versions per token).
2. ``judge_prompts`` (a per-group op of this file): one judge prompt per response, built
   from the policy's rollouts: the problem, with the policy's answer as the reference the
   judge's verdict is checked against.
3. ``generate(judge)``: the judge — a frozen copy of the warm-started arithmetic model
   (``model.path``; never trained, no weight sync, so it has no versions) — answers each
   problem greedily (temperature 0). Its prompts come from a per-group node, not
   from the dataset, so the runtime runs it per prompt group, as a per-group node with an
   engine of its own (``runtime.executors.fed_generate``), on its own mesh
   (``compile.allocation="gen:d1 + judge:d1 + train:d1"``) or time-sharing one.
4. ``reward(judge rollouts)``: the judge's text parsed into a score: 1 when the judge's
   integer equals the policy's answer, else 0 (``fn="arithmetic"`` with the policy's
   answer as the reference). The judge need not be good: it is the policy's warm start
   (``warm_start.teacher_bug_rate`` carry bug included), so agreeing with it rewards the
   start's greedy answers, right or wrong; the graph shows a second generating model
   scoring the first, its scores reaching the loss, not a better reward than the rule's.
5. ``advantage`` (GRPO: ``(r - mean) / (std + eps)`` per group) and ``train_step`` on the
   policy's rollouts with the judge's rewards; ``sync_weights`` reaches the policy's
   generator only.

Run: ``areal-flow run graphs/arith_grpo_judge.py`` (knobs in the YAML beside it).
"""

from areal_flow import Model, flow, ops
from areal_flow.ops import register_op


@register_op("judge_prompts", inputs={"rollouts": "rollouts"}, outputs={"prompts": "prompts"})
def judge_prompts(rollouts):
    """One judge prompt per response of the group, in the group's order: the problem text
    as the prompt, the policy's response text as the ``answer`` the judge is scored against."""
    return [{"id": t.meta.get("problem_id", 0), "prompt": t.prompt_text, "answer": t.output_text.strip()}
            for t in rollouts]


@flow
def arith_grpo_judge(cfg):
    policy = Model("policy", cfg.model)
    judge = Model("judge", cfg.model, trainable=False)  # the warm start, frozen
    prompts = ops.dataset(cfg.dataset)
    rollout = ops.generate(policy, prompts, n_samples=cfg.gen.n_samples, max_new_tokens=cfg.gen.max_new_tokens,
                           temperature=cfg.gen.temperature, top_p=cfg.gen.top_p, engine=cfg.gen.engine)
    asked = judge_prompts(rollout)
    verdict = ops.generate(judge, asked, n_samples=1, max_new_tokens=cfg.gen.max_new_tokens,
                           temperature=0.0, name="judge")  # greedy verdicts
    score = ops.reward(verdict, fn="arithmetic")  # 1 when the judge's integer equals the policy's answer
    adv = ops.advantage(rollout, score, estimator="grpo")
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_grpo_judge))
