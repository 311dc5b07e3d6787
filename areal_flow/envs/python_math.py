"""``python_math``: answer a math question, with a Python tool run in a sandbox.

The most common agentic setting for math (a policy that computes with code before it
answers). Tools (OpenAI function schema, parsed by :mod:`areal_flow.envs.tools`):

* ``python(code)``: runs ``code`` with :func:`areal_flow.envs.sandbox.run_python` (a
  separate, limited process); the observation is what it printed, its error, or why it
  was stopped (timeout, CPU, memory), truncated to ``python_max_output`` bytes. Hostile
  code (an infinite loop, a fork bomb, a huge allocation, a flood of output) ends only its
  own call; the episode goes on.
* ``answer(value)``: the final answer; ends the episode.

A plain-text turn (no call) is the final answer too. The final answer earns
``areal_flow.rewards.math.math_reward(answer, row["answer"])`` (1.0 or 0.0); every turn
that does not end the episode earns ``-turn_cost`` (config, default 0). Any dataset whose
rows carry ``prompt`` and a numeric ``answer`` (arithmetic, gsm8k) serves as its data:
``ops.rollout(policy, prompts, env="python_math")``.
"""

from __future__ import annotations

from areal_flow.envs.base import BaseEnv, EnvError, register_env, turn_cost
from areal_flow.envs.sandbox import run_python
from areal_flow.envs.tools import ToolCall, ToolCallError, parse_tool_call

TOOLS = [
    {"type": "function", "function": {
        "name": "python", "description": "run a python script and see what it prints (print the result)",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "python source"}},
                       "required": ["code"]}}},
    {"type": "function", "function": {
        "name": "answer", "description": "give the final answer (ends the conversation)",
        "parameters": {"type": "object", "properties": {"value": {"type": "string", "description": "the answer"}},
                       "required": ["value"]}}},
]
LIMITS = {"python_timeout_s": 5.0, "python_cpu_s": 5, "python_memory_mb": 512, "python_max_output": 1000}
"""Config keys of the sandbox limits and their defaults: wall-clock seconds, CPU seconds,
address space MiB, bytes of stdout / stderr shown (``run_python``'s ``timeout_s``,
``cpu_s``, ``memory_mb``, ``max_output``)."""


@register_env("python_math")
class PythonMathEnv(BaseEnv):
    """One question; the policy may run Python before it answers.

    Config (the dataset row merged over ``env.config``): ``prompt`` (the question),
    ``answer`` (the reference), ``turn_cost`` (default 0.0) and the :data:`LIMITS` keys.
    Keep ``env.step_timeout_s`` above ``python_timeout_s`` (a call blocks its step).

    ``step`` returns ``info = {"success": 0/1, "python_calls": 0/1, "python_errors": 0/1,
    "tool_error": 0/1}`` (``python_errors``: the code raised, exited non-zero or was
    killed; ``tool_error``: a malformed call or an unknown tool).

    Raises:
        EnvError: ``prompt`` or ``answer`` missing, a limit not a number > 0, or
            ``turn_cost`` not a number >= 0.
    """

    tools = TOOLS

    def __init__(self, config: dict | None = None) -> None:
        super().__init__(config)
        for key in ("prompt", "answer"):
            if self.config.get(key) in (None, ""):
                raise EnvError(f"python_math: config {key} is missing (the dataset row's {key})")
        self.limits = {}
        for key, default in LIMITS.items():
            value = self.config.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise EnvError(f"python_math: config {key}={value!r}, expected a number > 0")
            self.limits[key] = value
        self.turn_cost = turn_cost("python_math", self.config, 0.0)

    def reset(self) -> str:
        return str(self.config["prompt"])

    def step(self, action) -> tuple[str, float, bool, dict]:
        if isinstance(action, str):
            action = parse_tool_call(action, self.tools)
        if isinstance(action, ToolCallError):
            if not action.is_call_attempt:
                return self._final(action.text)
            return self._go_on(f"error: {action.reason}", tool_error=1)
        if not isinstance(action, ToolCall):
            raise EnvError(f"python_math: step() takes a ToolCall, ToolCallError or str, got {type(action).__name__}")
        if action.name == "answer":
            return self._final(action.arguments["value"])
        result = run_python(action.arguments["code"], timeout_s=float(self.limits["python_timeout_s"]),
                            cpu_s=max(1, int(self.limits["python_cpu_s"])),
                            memory_mb=int(self.limits["python_memory_mb"]),
                            max_output=int(self.limits["python_max_output"]))
        failed = result.timed_out or bool(result.exit_code)
        return self._go_on(result.observation(float(self.limits["python_timeout_s"])), python_calls=1,
                           python_errors=int(failed))

    def _final(self, text: str) -> tuple[str, float, bool, dict]:
        from areal_flow.rewards.math import math_reward

        success = math_reward(str(text), str(self.config["answer"])) == 1.0
        return "done.", float(success), True, {"success": int(success), "python_calls": 0, "python_errors": 0,
                                               "tool_error": 0}

    def _go_on(self, observation: str, python_calls: int = 0, python_errors: int = 0,
               tool_error: int = 0) -> tuple[str, float, bool, dict]:
        return observation, -self.turn_cost, False, {"success": 0, "python_calls": python_calls,
                                                     "python_errors": python_errors, "tool_error": tool_error}
