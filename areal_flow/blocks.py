"""Sub-graphs every RL graph in ``graphs/`` shares, so a graph file shows only what is
specific to its algorithm (estimator, loss, filter, critic, reference model).

Both functions only record ``ops.*`` nodes (call them inside a ``@flow``); nothing runs.

* :func:`sample_groups`: ``dataset -> generate``: prompts from ``cfg.dataset``, a group
  of ``cfg.gen.n_samples`` responses per prompt from the policy.
* :func:`train_policy`: ``train_step -> sync_weights``: the policy's optimizer step on a
  bounded-staleness edge (``async.max_staleness``), its new weights back to the generator.
"""

from __future__ import annotations

from typing import Any

from areal_flow import ops
from areal_flow.tracing import Handle, Model, current_graph
from areal_flow.graph import GraphError


def sample_groups(policy: Model, cfg: Any) -> Handle:
    """Record ``dataset -> generate`` with ``cfg.dataset`` and ``cfg.gen``; returns the
    ``rollouts`` handle (groups of ``cfg.gen.n_samples`` trajectories)."""
    prompts = ops.dataset(cfg.dataset)
    return ops.generate(
        policy,
        prompts,
        n_samples=cfg.gen.n_samples,
        max_new_tokens=cfg.gen.max_new_tokens,
        temperature=cfg.gen.temperature,
        top_p=cfg.gen.top_p,
        engine=cfg.gen.engine,
    )


def train_policy(policy: Model, advantages: Handle, rollouts: Handle, cfg: Any, *, algorithm: str) -> Handle:
    """Record the policy's ``train_step`` (registered ``algorithm``, loss knobs from
    ``train.loss``) and the ``sync_weights`` to the generator of ``rollouts``.

    A graph that names its algorithm here fixes it: ``train.algorithm`` in the config must
    say the same, so an override cannot be silently ignored.

    Returns:
        the ``stats`` handle.

    Raises:
        GraphError: ``cfg.train.algorithm`` differs from ``algorithm`` (naming the graph).
    """
    if cfg.train.algorithm != algorithm:
        raise GraphError(
            f"graph '{current_graph().name}' trains with algorithm {algorithm!r} but train.algorithm="
            f"{cfg.train.algorithm!r}; set train.algorithm={algorithm} or use the graph of that algorithm"
        )
    stats = ops.train_step(policy, advantages, algorithm=algorithm, max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollouts)
    return stats
