"""Name -> algorithm class registry, so a config can say ``train.algorithm=grpo``.

A plain dict filled only by ``@register_algorithm`` decorators: this package's own
algorithms register in ``builtin.py`` (imported at the end of this module, so every
user of the registry sees them); a user's subclass registers when the user's module is
imported. Their torch-free names and metadata for tracing are ``catalog.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.config import LossConfig

_REGISTRY: dict[str, type[BaseAlgorithm]] = {}

A = TypeVar("A", bound=type[BaseAlgorithm])


def register_algorithm(name: str) -> Callable[[A], A]:
    """Class decorator: register a ``BaseAlgorithm`` subclass under ``name`` (also sets
    ``cls.name``).

    Raises:
        TypeError: the class is not a ``BaseAlgorithm`` subclass.
        ValueError: empty name, or ``name`` already taken by another class.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"algorithm name must be a non-empty string, got {name!r}")

    def deco(cls: A) -> A:
        if not (isinstance(cls, type) and issubclass(cls, BaseAlgorithm)):
            raise TypeError(f"@register_algorithm({name!r}) needs a BaseAlgorithm subclass, got {cls!r}")
        other = _REGISTRY.get(name)
        if other is not None and other is not cls:
            owner = f"{other.__module__}.{other.__qualname__}"
            raise ValueError(f"algorithm name {name!r} is already registered to {owner}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def registered_algorithms() -> list[str]:
    """Sorted names of all registered algorithms."""
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> type[BaseAlgorithm]:
    """The class registered as ``name``.

    Raises:
        ValueError: unknown name; the message lists the registered names.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; registered: {registered_algorithms()}") from None


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


# After the registry exists: the built-ins register themselves through it.
from areal_flow.algorithms import builtin  # noqa: E402,F401
