"""``ops.dataset``: the source node that yields prompts (one per prompt group).

Port schema: no inputs; output ``prompts``. The worker side, :func:`build_task`, turns
the node's attributes into a task object with ``train_problems(n, seed)``,
``test_set()`` and ``reward(output_text, answer)``.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from areal_flow.tracing import Handle, outputs, record
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
        GraphError: a dict key that is no ``DatasetConfig`` field (with a did-you-mean), or a
            value ``DatasetConfig`` refuses (an unknown task, a key out of range: its check, the
            one every config source passes), naming the node and graph file:line.
    """
    attrs = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)
    node = record(SPEC, {}, attrs=attrs, name=name)
    from areal_flow.config import ConfigError, DatasetConfig  # here: `import areal_flow` stays without the compiler

    check_arguments(node.where(), attrs, [f.name for f in dataclasses.fields(DatasetConfig)], taker="dataset config")
    try:
        DatasetConfig(**attrs)
    except ConfigError as exc:
        raise GraphError(f"{node.where()}: {exc}") from None
    return outputs(node, SPEC)


def check_values(cfg: Any) -> None:
    """Refuse dataset values no task takes (``DatasetConfig.__post_init__`` calls it, so YAML files,
    overrides, a graph's own dict and a plan's dataset node all pass here): a known ``name``, the
    keys that task reads in range, ``path`` only for gsm8k (whether the file exists is checked
    where the run starts, ``runtime.preflight``: a plan may be compiled on another machine).

    Args:
        cfg: a :class:`~areal_flow.config.DatasetConfig`.

    Raises:
        ConfigError: one line naming the ``dataset.<key>``, its value and what it takes.
    """
    from areal_flow.config import ConfigError

    if cfg.name not in TASKS:
        near = difflib.get_close_matches(str(cfg.name), TASKS, n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise ConfigError(f"dataset.name={cfg.name!r}: unknown task; known: {', '.join(TASKS)}{hint}")
    if not isinstance(cfg.path, str) or (cfg.path and cfg.name != "gsm8k"):
        raise ConfigError(f"dataset.path={cfg.path!r}: the {cfg.name} task reads no data file (only gsm8k does); "
                          "remove dataset.path")
    low, high = {"arithmetic": (1, None), "support_desk": (1, 6)}.get(cfg.name, (None, None))
    n = cfg.max_digits
    in_range = isinstance(n, int) and not isinstance(n, bool) and low is not None and n >= low \
        and (high is None or n <= high)
    if low is not None and not in_range:
        span = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ConfigError(f"dataset.max_digits={n!r}: the {cfg.name} task takes an int {span}")
    if cfg.name == "arithmetic":
        if not isinstance(cfg.ops, str) or not cfg.ops or set(cfg.ops) - set("+-"):
            raise ConfigError(f"dataset.ops={cfg.ops!r}: expected the operators to draw from: '+', '-' or '+-'")
        if cfg.prompt_style not in ("plain", "chat"):
            raise ConfigError(f"dataset.prompt_style={cfg.prompt_style!r}: expected 'plain' or 'chat'")


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
