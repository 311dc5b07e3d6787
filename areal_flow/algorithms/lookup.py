"""Looking up registered algorithms by name, built-ins included.

Owns ``build_algorithm``; importing it registers the built-in algorithms (``builtin.py``), so
its ``get_algorithm`` and ``registered_algorithms`` (the registry's) see them too.
"""

from __future__ import annotations

from typing import Any

from areal_flow.algorithms import builtin  # noqa: F401  (registers the built-ins)
from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.config import LossConfig
from areal_flow.algorithms.registry import get_algorithm, registered_algorithms

__all__ = ["build_algorithm", "get_algorithm", "registered_algorithms"]


def build_algorithm(
    name: str,
    model: Any,
    optimizer: Any,
    *,
    loss_cfg: LossConfig | None = None,
    loss_overrides: dict[str, Any] | None = None,
    **kwargs: Any,
) -> BaseAlgorithm:
    """Instantiate the algorithm ``name``.

    Args:
        name: registered name (``registered_algorithms()``).
        model, optimizer: policy model and its optimizer.
        loss_cfg: full loss config; default ``cls.default_loss_config(**loss_overrides)``.
        loss_overrides: ``LossConfig`` fields to change from the algorithm's defaults
            (not allowed together with ``loss_cfg``).
        **kwargs: the keyword arguments of ``BaseAlgorithm.__init__``
            (``micro_batch_size``, ``max_grad_norm``, ``temperature``, ``critic``,
            ``critic_optimizer``, ``ref_model``).

    Raises:
        ValueError: unknown name, unknown override key, or both ``loss_cfg`` and
            ``loss_overrides``.
    """
    cls = get_algorithm(name)
    if loss_cfg is not None and loss_overrides:
        raise ValueError("build_algorithm: pass loss_cfg or loss_overrides, not both")
    cfg = loss_cfg if loss_cfg is not None else cls.default_loss_config(**(loss_overrides or {}))
    return cls(cfg, model, optimizer, **kwargs)
