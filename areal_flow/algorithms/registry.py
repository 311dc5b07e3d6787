"""Name -> algorithm class registry, so a config can say ``train.algorithm=grpo``.

A plain dict filled only by ``@register_algorithm`` decorators: this package's own
algorithms register in ``builtin.py``, a user's subclass when the user's module is imported.
Lookups that must see the built-ins are ``lookup.py`` (which imports ``builtin.py``), so this
module imports none of them. Their torch-free names and metadata for tracing are ``catalog.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from areal_flow.algorithms.base import BaseAlgorithm

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
