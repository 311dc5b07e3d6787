"""GRPO on GSM8K with SmolLM2-135M-Instruct on CPU: a real model on real word problems.

The same algorithm as ``graphs/arith_grpo.py`` (Shao et al. 2024, DeepSeekMath §4.1),
with a pretrained chat model instead of a tiny one:

1. ``dataset``: GSM8K training problems (Cobbe et al. 2021), the bare question as prompt.
2. ``generate``: the question becomes one user turn of SmolLM2's chat template (ChatML,
   ``ops.generate(chat_template=None)`` detects it); the policy samples a group of
   ``n_samples`` worked answers, recording behavior log-probs and versions.
3. ``reward``: the math reward: 1 when the reply's final answer equals the reference.
4. ``advantage``: group-relative (r - mean(group)) / (std(group) + eps).
5. ``train_step``: PPO-clipped policy loss, AdamW, bounded staleness.
6. ``sync_weights``: new versions go to the generator between decode steps.

No warm start: ``model.path: smollm2-135m`` is the converted GGUF as it is. The default
config is sized for 2 CPU cores (4 steps, pass@1 on 20 test problems; measured 27 minutes
on a shared, busy machine, numbers in ``docs/GSM8K.md``): it shows the loop running on a
real model, not a GSM8K gain (0% pass@1 before and after); that needs ~100x the steps.

Run: ``areal-flow run graphs/gsm8k_grpo.py --config graphs/gsm8k_grpo.yaml scheduler.type=local``
or ``python graphs/gsm8k_grpo.py`` (knobs in ``graphs/gsm8k_grpo.yaml``).
"""

from areal_flow import Model, flow, ops
from areal_flow.blocks import sample_groups, train_policy


@flow
def gsm8k_grpo(cfg):
    policy = Model("policy", cfg.model)
    rollout = sample_groups(policy, cfg)  # dataset -> generate (chat template applied)
    reward = ops.reward(rollout, fn="gsm8k")
    adv = ops.advantage(rollout, reward, estimator="grpo")
    return train_policy(policy, adv, rollout, cfg, algorithm="grpo")  # train_step -> sync_weights


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(gsm8k_grpo))
