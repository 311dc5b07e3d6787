"""GRPO on a reasoning-gym task with a tiny model: any reasoning-gym dataset, unchanged.

The algorithm of ``graphs/arith_grpo.py`` (Shao et al. 2024, DeepSeekMath §4.1) on a task
of the reasoning-gym package (Stojanovski et al. 2025, arXiv:2505.24760):

1. ``dataset``: ``dataset.name: reasoning_gym:<dataset>`` draws the dataset's entries
   (``reasoning_gym.create_dataset(<dataset>, seed=..., size=..., **dataset.options)``);
   the prompt is the entry's question (``areal_flow.tasks.rgym``).
2. ``generate``: a group of ``n_samples`` answers per prompt.
3. ``reward``: ``fn="reasoning_gym"``: the dataset's own ``score_answer`` on the answer
   (the last ``<answer>...</answer>``, else the whole reply), in [0, 1].
4. ``advantage``, ``train_step``, ``sync_weights``: as in ``arith_grpo``.

The yaml trains the tiny character model on ``basic_arithmetic`` restricted to two terms of
one or two digits, ``+`` and ``-`` ("Calculate 10 + 3." -> "13"; the capital C is the
character tokenizer's ``<unk>``), after a short supervised warm start on the entries'
answers. Another task: ``dataset.name=reasoning_gym:<name>`` and its ``dataset.options``
(a real model for tasks whose questions outgrow the tiny model's 256-token context).

Run: ``areal-flow run graphs/rg_grpo.py`` (knobs in ``graphs/rg_grpo.yaml``).
"""

from areal_flow import Model, flow, ops


@flow
def rg_grpo(cfg):
    policy = Model("policy", cfg.model)
    prompts = ops.dataset(cfg.dataset)
    rollout = ops.generate(policy, prompts, n_samples=cfg.gen.n_samples, max_new_tokens=cfg.gen.max_new_tokens,
                           temperature=cfg.gen.temperature, top_p=cfg.gen.top_p, engine=cfg.gen.engine)
    reward = ops.reward(rollout, fn="reasoning_gym")
    adv = ops.advantage(rollout, reward)
    stats = ops.train_step(policy, adv, algorithm=cfg.train.algorithm, max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(rg_grpo))
