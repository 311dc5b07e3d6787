"""Agent programs written with the OpenAI Agents SDK (``openai-agents``) as rollout agents.

An SDK agent (an ``agents.Agent`` with ``function_tool`` tools, run by ``agents.Runner``)
trains unchanged but for its model's base URL: the SDK's documented way to use any
OpenAI-compatible server is an ``openai.AsyncOpenAI(base_url=...)`` client wrapped in
``agents.OpenAIChatCompletionsModel``, and the rollout gives every episode its own base URL
on the generation worker's endpoint (``runtime.executors.agent_endpoint``). Each model call
the Runner makes is one policy turn; a tool call the policy writes comes back as
``tool_calls`` (the SDK runs the tool), and the tool's result, which the SDK sends as a
``tool`` message in the next call, is an observation (masked out of the loss). So the
episode is recorded exactly as one written with the ``openai`` client.

:func:`sdk_program` turns ``async def program(base_url, row) -> reward`` into the
``agent(base_url, row)`` that ``ops.rollout(..., agent=...)`` calls in the episode's
thread: it disables the SDK's tracing (its exporter would post traces to OpenAI; nothing
here reaches the network) and runs the coroutine in a fresh event loop.

``openai-agents`` is an optional dependency (the ``envs`` extra): the SDK is imported
only when a program runs, and its absence is one clear ``ImportError``
(:func:`require_agents`).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Awaitable, Callable

EXTRA_HINT = "pip install 'areal-flow[envs]' (openai-agents==0.24.0)"

TRUNCATION_CODES = ("max_turns_reached", "context_length_exceeded")
"""The endpoint's error codes that end an episode normally (cut at the rollout's
``max_turns`` or ``max_context``), not as a failure."""


def require_agents():
    """The ``agents`` module (the OpenAI Agents SDK).

    Raises:
        ImportError: the SDK is not installed, naming the extra that installs it.
    """
    try:
        import agents
    except ImportError as exc:
        raise ImportError(f"the OpenAI Agents SDK (package openai-agents, module agents) is not installed: "
                          f"{EXTRA_HINT}") from exc
    return agents


def sdk_program(fn: Callable[[str, dict], Awaitable[float | None]] | None = None, *,
                truncated_reward: float = 0.0):
    """Decorator: an ``async def fn(base_url, row)`` SDK program as a rollout agent.

    Use as ``@sdk_program`` or ``@sdk_program(truncated_reward=-1.0)``.

    Args:
        fn: the program: builds its ``AsyncOpenAI(base_url=base_url, ...)`` client and SDK
            model, runs its Agent with ``Runner.run`` and returns the episode's reward
            (added to the last policy turn's) or ``None``.
        truncated_reward: what an episode cut short earns: the SDK's own ``max_turns``
            (``agents.exceptions.MaxTurnsExceeded``) or the endpoint's refusal of a call past
            the rollout's ``max_turns`` / ``max_context`` (HTTP 400, codes
            :data:`TRUNCATION_CODES`). Its recorded turns are trained as they are.

    Returns:
        ``agent(base_url, row) -> float | None``, a plain function (it travels with the
        plan by value, as any agent program).

    Raises (from the returned agent): ``ImportError`` without the SDK; whatever ``fn``
    raises otherwise (the episode fails and is counted, as for any agent program).
    """

    def wrap(program):
        @functools.wraps(program)
        def agent(base_url: str, row: dict) -> float | None:
            sdk = require_agents()
            import openai

            sdk.set_tracing_disabled(True)  # process-wide: the trace exporter posts to api.openai.com
            try:
                return asyncio.run(program(base_url, row))
            except sdk.exceptions.MaxTurnsExceeded:
                return truncated_reward
            except openai.BadRequestError as exc:
                if exc.code in TRUNCATION_CODES:
                    return truncated_reward
                raise

        return agent

    return wrap(fn) if fn is not None else wrap
