"""Name -> algorithm class registry, so a config can say ``train.algorithm=grpo``.

A plain dict filled only by ``@register_algorithm`` decorators: this package's own
algorithms register in ``builtin.py`` (one per row of ``catalog.ALGORITHMS``), a user's
subclass when the user's module is imported (or a worker reads it from the plan).
Lookups that must see the built-ins are ``lookup.py`` (which imports ``builtin.py``), so this
module imports none of them. Their torch-free names and metadata for tracing are ``catalog.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.catalog import ALGORITHMS

_REGISTRY: dict[str, type[BaseAlgorithm]] = {}
BUILTIN_MODULE = "areal_flow.algorithms.builtin"
"""The module whose classes may take the built-in names (it registers one per ``catalog.ALGORITHMS`` row)."""

A = TypeVar("A", bound=type[BaseAlgorithm])


def register_algorithm(name: str) -> Callable[[A], A]:
    """Class decorator: register a ``BaseAlgorithm`` subclass under ``name`` (also sets
    ``cls.name``).

    The same class again (a graph file imported twice, or the copy a plan carries:
    ``runtime.plan_ops``) replaces the first.

    Raises:
        TypeError: the class is not a ``BaseAlgorithm`` subclass.
        ValueError: empty name, a built-in algorithm's name (``catalog.ALGORITHMS``) for a
            class of another module, or ``name`` already taken by another class.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"algorithm name must be a non-empty string, got {name!r}")

    def deco(cls: A) -> A:
        if not (isinstance(cls, type) and issubclass(cls, BaseAlgorithm)):
            raise TypeError(f"@register_algorithm({name!r}) needs a BaseAlgorithm subclass, got {cls!r}")
        if name in ALGORITHMS and cls.__module__ != BUILTIN_MODULE:
            raise ValueError(f"algorithm '{name}' is built in; register yours under another name")
        other = _REGISTRY.get(name)
        if other is not None and (other.__module__, other.__qualname__) != (cls.__module__, cls.__qualname__):
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
