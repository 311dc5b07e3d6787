"""An agent program written against the OpenAI API, trained with GRPO as a graph node.

The agent is ordinary client code: it gets a ``base_url`` (one per episode, served by the
generation worker) and a dataset row, talks to the policy with the official ``openai``
client, and returns a reward. Every chat call is one policy turn of a multi-turn
trajectory; the messages it adds between calls are observations (masked out of the loss).
Rules: each call repeats the previous call's messages plus the reply it got (the episode
is one conversation), sampling settings are the rollout node's (a request's
``temperature`` is ignored), and after ``max_turns`` calls the endpoint answers 400.

Run (2 CPU cores, the arithmetic task and its tiny character model):

    areal-flow run graphs/arith_openai_agent.py
"""

from __future__ import annotations

import openai

from areal_flow import Model, flow, ops
from areal_flow.envs.agent import set_reward


def agent(base_url: str, row: dict) -> float:
    """Answer ``row["prompt"]`` (e.g. ``"37+58="``); one retry after a wrong answer.

    Returns:
        1.0 for a correct final answer, else 0.0 (added to the last turn's reward).
    """
    # one client per episode: its calls share one keep-alive connection, closed when the episode ends
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        messages = [{"role": "user", "content": row["prompt"]}]
        for turn in range(2):
            reply = client.chat.completions.create(model="policy", messages=messages)
            answer = (reply.choices[0].message.content or "").strip()
            if answer == row["answer"]:
                return 1.0
            if turn == 0:
                set_reward(base_url, -0.1)  # credit the missed first turn itself
                messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": "again="}]
    return 0.0


@flow
def openai_agent_grpo(cfg):
    policy = Model("policy", cfg.model)
    episodes = ops.rollout(policy, ops.dataset(cfg.dataset), agent=agent, max_turns=2, gamma=0.9,
                           n_samples=cfg.gen.n_samples, max_new_tokens=cfg.gen.max_new_tokens)
    adv = ops.advantage(episodes, estimator="grpo")
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=episodes)
    return stats
