"""``ops.dataset``: the source node that yields prompts (one per prompt group).

Port schema: no inputs; output ``prompts``. The worker side, ``areal_flow.tasks.catalog.build_task``, turns
the node's attributes into a task object with ``train_problems(n, seed)``,
``test_set()`` and ``reward(output_text, answer)``; a task that judges single responses
(arithmetic, gsm8k, longtail) also has ``correct(output_text, answer) -> bool``, which
sets each trajectory's ``correct`` (the run's accuracy), whatever the reward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from areal_flow.tracing import Handle, outputs, record
from areal_flow.graph import GraphError, OpSpec, PortSpec
from areal_flow.ops.registry import CPU, SOURCE, OpDef, check_arguments, define, op_function

SPEC = OpSpec("dataset", inputs=(), outputs=(PortSpec("prompts", "prompts"),))
OP = define(OpDef(SPEC, SOURCE, CPU, "areal_flow.tasks.catalog:build_task"))

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
