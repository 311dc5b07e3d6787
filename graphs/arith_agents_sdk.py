"""An agent written with the OpenAI Agents SDK, trained with GRPO as a graph node.

The agent is the SDK's own: an ``Agent`` with a ``function_tool`` (``add``), run by the
SDK's ``Runner``. The only change for training is the model's base URL: the SDK's
documented route to any OpenAI-compatible server, an ``AsyncOpenAI(base_url=...)`` client
in an ``OpenAIChatCompletionsModel``, pointed at the episode's ``base_url`` on the
generation worker. Every model call the Runner makes is one policy turn; a tool call the
policy writes (``add(37, 58)``) is run by the SDK, and its result comes back in the next
call as a ``tool`` message: an observation, masked out of the loss. ``sdk_program`` runs the
coroutine in the episode's thread with the SDK's tracing off (nothing reaches the network).

Run (2 CPU cores, the arithmetic task and its tiny character model; ``pip install
'areal-flow[envs]'`` brings the SDK):

    areal-flow run graphs/arith_agents_sdk.py
"""

from __future__ import annotations

from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from openai import AsyncOpenAI

from areal_flow import Model, flow, ops
from areal_flow.envs.agents_sdk import sdk_program


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term.
        b: the second term.
    """
    return a + b


@sdk_program
async def agent(base_url: str, row: dict) -> float:
    """Answer ``row["prompt"]`` (e.g. ``"37+58="``), with the ``add`` tool at hand.

    Returns:
        1.0 when the agent's final output is ``row["answer"]``, else 0.0.
    """
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        calculator = Agent(name="calculator", tools=[add],
                           model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
        result = await Runner.run(calculator, row["prompt"], max_turns=2, run_config=RunConfig(tracing_disabled=True))
    return 1.0 if str(result.final_output).strip() == row["answer"] else 0.0


@flow
def agents_sdk_grpo(cfg):
    policy = Model("policy", cfg.model)
    episodes = ops.rollout(policy, ops.dataset(cfg.dataset), agent=agent, max_turns=2, gamma=0.9,
                           n_samples=cfg.gen.n_samples, max_new_tokens=cfg.gen.max_new_tokens)
    adv = ops.advantage(episodes, estimator="grpo")
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=episodes)
    return stats
