"""The ``rollout`` node's executor: :class:`RolloutExecutor`, the episode loop
(``runtime.executors.episode_runner``) on an engine of its own, built from the node's attributes
and the replica's context; and :func:`episode_context`, the tokens an episode may hold.
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.executors.episode_failures import LOG_NAME
from runtime.executors.episode_runner import EpisodeRunner
from runtime.executors.generate import build_engine, sampling_params


def episode_context(attrs: dict, folder: str | Path) -> int:
    """Tokens an episode may hold: the rollout node's ``max_context``, else the
    ``max_position_embeddings`` of the model in ``folder`` (2048 when unstated)."""
    if attrs.get("max_context"):
        return int(attrs["max_context"])
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or 2048)


class RolloutExecutor(EpisodeRunner):
    """Grain ``stream`` executor of a ``rollout`` node on one generation replica (an
    ``areal_flow.ops.interfaces.StreamExecutor``; it owns its engine, :meth:`close` closes it).

    Args:
        node: the plan's rollout node (``areal_flow.ops.rollout`` attributes, ``max_batch_size``)
            and its planned ``concurrent`` sequences per replica.
        ctx: the replica's :class:`runtime.context.WorkerContext`.

    Raises:
        EnvError: unknown env name. EngineRefused: as ``GenerateExecutor``.
    """

    def __init__(self, node, ctx) -> None:
        self.node = node
        super().__init__(build_engine(node, ctx), ctx.tokenizer, node.attrs, sampling_params(node),
                         episode_context(node.attrs, ctx.folders[node.model]), Path(ctx.out_dir) / LOG_NAME, node.name)
        self.where = f"rollout node '{node.name}' ({self.where})"

    def close(self) -> None:
        """Stop the agent endpoint (if one started), then close the engine."""
        super().close()
        self.engine.close()
