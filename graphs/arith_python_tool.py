"""Multiplication with a Python tool, trained with multi-turn RL: the policy learns to call the tool.

Read top to bottom, this is the whole algorithm:

1. ``dataset``: ``a*b=`` problems, operands of 2-3 digits (``areal_flow/tasks/tool_multiply.py``):
   products the tiny model cannot compute in its head, but can copy.
2. Before RL, the tiny model is warm-started (cached) on scripted dialogues: half of them call
   the tool, ``python(print(347*29))``, read its output ``10063`` and answer ``10063``; the
   other half (``warm_start.teacher_bug_rate``) answer at once without the tool. So the policy
   knows the call format but calls the tool on only about half of the problems.
3. ``rollout``: ``n_samples`` episodes per problem against the ``python_math`` env
   (``areal_flow/envs/python_math.py``): a policy turn ``python(code)`` runs the code in a
   sandboxed child process (``areal_flow/envs/sandbox.py``) and shows what it printed; a
   plain-text turn is the final answer, rewarded 1 when it is the product
   (``areal_flow.rewards.math.math_reward``), else 0. The tool's output sits in the
   trajectory, masked out of the loss.
4. ``advantage``: each episode's return, group-relative over the ``n_samples`` episodes of a
   problem (GRPO, Shao et al. 2024, §4.1.2, over whole episodes).
5. ``train_step``: PPO-clipped policy loss on the policy's tokens, averaged per episode;
   samples arrive at most ``async.max_staleness`` versions old.
6. ``sync_weights``: new versions reach the generator between engine steps.

Run: ``areal-flow run graphs/arith_python_tool.py`` (knobs in ``graphs/arith_python_tool.yaml``).
The held-out success rate (and ``env/python_calls`` per episode), before and after RL, is
printed at the end; measured results (three seeds) in docs/AGENTS.md, "Measured: the Python tool".
"""

from areal_flow import Model, flow, ops


@flow
def arith_python_tool(cfg):
    policy = Model("policy", cfg.model)
    problems = ops.dataset(cfg.dataset)  # tool_multiply: "347*29=" -> "10063"
    episodes = ops.rollout(
        policy,
        problems,
        env=cfg.env.name,  # "python_math": tools python(code) and answer(value)
        max_turns=cfg.env.max_turns,
        gamma=cfg.env.gamma,
        step_timeout_s=cfg.env.step_timeout_s,  # above env.config.python_timeout_s
        env_config=cfg.env.config,  # the sandbox limits
        n_samples=cfg.gen.n_samples,
        max_new_tokens=cfg.gen.max_new_tokens,  # per policy turn
        temperature=cfg.gen.temperature,
    )
    adv = ops.advantage(episodes)  # train.algorithm's estimator over the episodes' returns
    stats = ops.train_step(policy, adv, algorithm=cfg.train.algorithm, max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=episodes)
    return stats


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_python_tool))
