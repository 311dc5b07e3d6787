"""A ``verifiers`` environment (prime-rl's format) trained with GRPO over whole episodes.

``env="verifiers:<env id or module>"`` loads the environment with
``verifiers.load_environment(<id>, **env.config)`` and plays *its* rollouts: its own loop
(single-turn, ``env_response`` between turns, tool calls, stop conditions) talks to the
policy through the generation worker's OpenAI-compatible endpoint, each model call is one
policy turn (exact sampled ids, per-token versions), every message the environment adds
is a masked observation, and its rubric's score is the episode's reward
(``areal_flow/envs/verifiers_env.py``).

The yaml trains ``areal_flow/envs/vf_arith.py``, an arithmetic environment written in the
verifiers format (``turns: 2``: a wrong first answer gets ``"again="``; rubric: 1 for the
right last answer, -0.1 per extra turn), on its own dataset (``dataset.name:
verifiers:<env id>``), with the tiny character model. Any installed verifiers environment
runs the same way: its id in ``dataset.name`` and ``env.name``, its ``load_environment``
arguments under ``dataset.options`` and ``env.config``, and a model that can read its
prompts (``model.path``, ``compile.max_prompt_len``).

Run (2 CPU cores; ``pip install 'areal-flow[envs]'`` brings verifiers):

    areal-flow run graphs/verifiers_agent.py
"""

from __future__ import annotations

from areal_flow import Model, flow, ops


@flow
def verifiers_agent(cfg):
    policy = Model("policy", cfg.model)
    problems = ops.dataset(cfg.dataset)  # verifiers:<env id>: the environment's own rows (chat messages, answer)
    episodes = ops.rollout(
        policy,
        problems,
        env=cfg.env.name,  # "verifiers:areal_flow.envs.vf_arith"
        env_config=cfg.env.config,  # the environment's load_environment arguments
        max_turns=cfg.env.max_turns,  # at least the environment's own
        gamma=cfg.env.gamma,
        step_timeout_s=cfg.env.step_timeout_s,
        n_samples=cfg.gen.n_samples,
        max_new_tokens=cfg.gen.max_new_tokens,
        temperature=cfg.gen.temperature,
    )
    adv = ops.advantage(episodes)  # train.algorithm's estimator over the rubric's scores
    stats = ops.train_step(policy, adv, algorithm=cfg.train.algorithm, max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=episodes)
    return stats


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(verifiers_agent))
