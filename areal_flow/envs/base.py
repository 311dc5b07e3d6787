"""The environment interface of multi-turn rollouts, and the registry that names envs.

Owns :class:`BaseEnv` (the gym-style ``reset`` / ``step`` contract a user subclasses),
:func:`register_env` and :func:`make_env`. An environment is plain Python: it never sees
tokens, only text (or chat messages) and the policy's turn as text or a parsed tool call
(:mod:`areal_flow.envs.tools`). The episode loop that drives it is
``runtime.executors.episode_runner``; one env instance serves exactly one episode, so state never
leaks between episodes.
"""

from __future__ import annotations

from typing import Any, Callable

_ENVS: dict[str, type] = {}


class EnvError(ValueError):
    """An unknown env name, or an env that breaks the interface (named)."""


def turn_cost(env: str, config: dict, default: float) -> float:
    """``config["turn_cost"]`` (the reward of a turn that does not end the episode is its
    negative; ``default`` when absent) of the env named ``env``.

    Raises:
        EnvError: a value that is not a number >= 0 (names the env and the key).
    """
    value = config.get("turn_cost", default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise EnvError(f"{env}: config turn_cost={value!r}, expected a number >= 0 (env.config.turn_cost)")
    return float(value)


class BaseEnv:
    """One episode of an environment (Gymnasium's ``reset``/``step`` contract, with text).

    Subclass it, register it with ``@register_env("name")`` and name it in a graph:
    ``ops.rollout(policy, prompts, env="name")``.

    Attributes:
        config: the dict the env was built from: the dataset row of the episode (``id``,
            ``prompt``, task fields) merged over the node's ``env_config``, a deep copy the
            episode owns (the rollout loop makes it): changing it, lists and dicts inside
            included, changes no other episode, the dataset or the node.
        observation_space: a description of a valid observation (``"text"`` or
            ``"messages"``); the loop checks every observation against it.
        tools: the tool list in the OpenAI function-calling schema (``[{"type": "function",
            "function": {"name", "description", "parameters"}}]``) or ``None``; when set, the
            policy's turn is parsed into a :class:`~areal_flow.envs.tools.ToolCall` (or a
            :class:`~areal_flow.envs.tools.ToolCallError`) before ``step`` sees it, and a chat
            template renders the list (``tools=``).
        action_space: ``"text"`` (the raw turn) or ``"tool_call"`` (set when ``tools`` is).
    """

    observation_space: str = "text"
    tools: list[dict] | None = None

    def __init__(self, config: dict | None = None) -> None:
        self.config = dict(config or {})

    @property
    def action_space(self) -> str:
        return "tool_call" if self.tools else "text"

    def reset(self) -> Any:
        """Start the episode; returns the first observation (text, or a list of chat messages)."""
        raise NotImplementedError(f"{type(self).__name__}.reset")

    def step(self, action: Any) -> tuple[Any, float, bool, dict]:
        """Apply the policy's turn.

        Args:
            action: the turn's text (``action_space == "text"``), or a ``ToolCall`` /
                ``ToolCallError`` (``"tool_call"``).

        Returns:
            ``(observation, reward, done, info)``: the next observation (ignored when
            ``done``), this turn's reward (float), whether the episode ended, and a dict of
            scalars the run logs as ``env/<key>`` (e.g. ``resolved``).
        """
        raise NotImplementedError(f"{type(self).__name__}.step")

    def close(self) -> None:
        """Release what the episode held (called once, also after a failure)."""


def register_env(name: str) -> Callable[[type], type]:
    """Class decorator: make ``cls`` available as ``env=name`` in ``ops.rollout``.

    Raises:
        EnvError: ``cls`` is not a :class:`BaseEnv` subclass.
    """

    def add(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, BaseEnv)):
            raise EnvError(f"register_env({name!r}): {cls!r} is not a BaseEnv subclass")
        _ENVS[name] = cls
        return cls

    return add
