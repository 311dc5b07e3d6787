"""``ops.dataset``: the source node that yields prompts (one per prompt group).

Port schema: no inputs; output ``prompts``. The worker side, :func:`build_task`, turns
the node's attributes into a task object with ``train_problems(n, seed)``,
``test_set()`` and ``reward(output_text, answer)``; a task that judges single responses
(arithmetic, gsm8k, longtail) also has ``correct(output_text, answer) -> bool``, which
sets each trajectory's ``correct`` (the run's accuracy), whatever the reward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from areal_flow.dsl import Handle, outputs, record
from areal_flow.graph import GraphError, OpSpec, PortSpec
from areal_flow.ops.registry import CPU, SOURCE, OpDef, check_arguments, define, op_function

SPEC = OpSpec("dataset", inputs=(), outputs=(PortSpec("prompts", "prompts"),))
OP = define(OpDef(SPEC, SOURCE, CPU, "areal_flow.ops.dataset:build_task"))

TASKS = ("arithmetic", "gsm8k", "support_desk", "guess_number", "longtail")


@op_function
def dataset(cfg: Any, *, name: str | None = None) -> Handle:
    """Declare the prompt source.

    Args:
        cfg: a :class:`~areal_flow.config.DatasetConfig` (or a dict of its fields).
        name: node name (default ``"dataset"``).

    Returns:
        Handle of type ``prompts``.

    Raises:
        GraphError: a dict key that is no ``DatasetConfig`` field (with a did-you-mean), or
            an unknown task name (naming the node and graph file:line).
    """
    attrs = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)
    node = record(SPEC, {}, attrs=attrs, name=name)
    from areal_flow.config import DatasetConfig  # here, not at import: `import areal_flow` stays without the compiler

    check_arguments(node.where(), attrs, [f.name for f in dataclasses.fields(DatasetConfig)], taker="dataset config")
    task = attrs.get("name", "arithmetic")
    if task not in TASKS:
        raise GraphError(f"{node.where()}: dataset.name={task!r}: unknown task; known: {', '.join(TASKS)}")
    return outputs(node, SPEC)


def build_task(attrs: dict, seed: int) -> Any:
    """The task object of a dataset node (what the generation worker samples prompts from).

    Raises:
        ValueError: unknown task name, listing the known ones.
    """
    kind = attrs.get("name", "arithmetic")
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
    if kind == "longtail":
        from areal_flow.tasks.longtail import LongTailTask

        return LongTailTask(seed=seed)
    raise ValueError(f"dataset.name={kind!r}: unknown task; known: {', '.join(TASKS)}")
