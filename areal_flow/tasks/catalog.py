"""The tasks a dataset node can name, and building one from the node's attributes.

Owns the table of task names (``dataset.name``) and :func:`build_task`, the dataset op's
executor: the worker side that turns a node's attributes into the task object the router
samples prompts from. The value checks of ``dataset.*`` keys are
``areal_flow.config.DatasetConfig``'s.
"""

from __future__ import annotations

from typing import Any

TASKS = ("arithmetic", "gsm8k", "support_desk", "guess_number", "longtail", "tool_multiply")
"""The shipped tasks; besides them, ``reasoning_gym:<dataset>`` names any reasoning-gym
dataset (``areal_flow.tasks.rgym``) and ``verifiers:<env id>`` the dataset of a verifiers
environment (``areal_flow.tasks.verifiers_data``)."""


def build_task(attrs: dict, seed: int) -> Any:
    """The task object of a dataset node (what the generation worker samples prompts from).

    Raises:
        ValueError: unknown task name, listing the known ones; a reasoning-gym name or
            ``options`` it refuses (``areal_flow.tasks.rgym.check_task``).
    """
    kind = attrs.get("name", "arithmetic")
    if kind.startswith("verifiers:"):
        from areal_flow.envs.verifiers_env import check_spec
        from areal_flow.tasks.verifiers_data import VerifiersTask

        return VerifiersTask(check_spec(kind), attrs.get("options") or {}, seed=seed)
    if kind.startswith("reasoning_gym:"):
        from areal_flow.tasks.rgym import ReasoningGymTask, parse_name

        return ReasoningGymTask(parse_name(kind), seed=seed, options=attrs.get("options") or {},
                                prompt_style=attrs.get("prompt_style", "plain"))
    if kind == "arithmetic":
        from areal_flow.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(seed=seed, max_digits=attrs.get("max_digits", 3), ops=attrs.get("ops", "+-"),
                              prompt_style=attrs.get("prompt_style", "plain"))
    if kind == "gsm8k":
        from areal_flow.tasks.gsm8k import GSM8KTask

        return GSM8KTask(path=attrs.get("path") or None, seed=seed)
    if kind == "support_desk":
        from areal_flow.tasks.support_desk import SupportDeskTask

        return SupportDeskTask(seed=seed, order_digits=attrs.get("max_digits", 4))
    if kind == "guess_number":
        from areal_flow.tasks.guess_number import GuessNumberTask

        return GuessNumberTask(seed=seed)
    if kind == "tool_multiply":
        from areal_flow.tasks.tool_multiply import ToolMultiplyTask

        return ToolMultiplyTask(seed=seed, max_digits=attrs.get("max_digits", 3))
    if kind == "longtail":
        from areal_flow.tasks.longtail import LongTailTask

        return LongTailTask(seed=seed)
    raise ValueError(f"dataset.name={kind!r}: unknown task; known: {', '.join(TASKS)}")
