"""Lazy package exports (PEP 562): a package names its public objects without importing the
modules that define them until one is used.

Owns :func:`lazy_getattr`, the module ``__getattr__`` of ``areal_flow``, ``areal_flow.algorithms``
and ``compiler``: importing one module of them (the runtime reading a plan, tracing without
torch) does not load the rest.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``package`` that returns ``exports[name]``'s object ``name`` (or the
    module itself when the module's last component is ``name``), importing it on first use.

    Raises (from the returned function):
        AttributeError: ``name`` is not exported (naming the package).
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        loaded = import_module(module)
        return loaded if module.rsplit(".", 1)[-1] == name else getattr(loaded, name)

    return __getattr__
