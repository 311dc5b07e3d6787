"""Hides installed packages from this interpreter and every process it starts, so a CPU dry
run (``bench/gpu_check.sh --dry-run``) imports only what the GPU machine will have.

Active only when this folder is on ``PYTHONPATH`` (Python imports ``sitecustomize`` at start-up)
and ``GPU_CHECK_HIDE`` names top-level modules (spaces or commas between them). A hidden module
looks absent, as on a machine without it: ``import x`` raises ``ModuleNotFoundError`` and
``importlib.util.find_spec("x")`` returns None (so optional-import checks, e.g. transformers',
take their "not installed" branch). Child processes inherit the variable and ``PYTHONPATH``,
so spawned workers are covered too. Every hidden import that was attempted is appended to the
file ``GPU_CHECK_HIDE_LOG`` when set (one ``module<TAB>pid`` line each).
"""

from __future__ import annotations

import os
import sys

_HIDDEN = frozenset(n for n in os.environ.get("GPU_CHECK_HIDE", "").replace(",", " ").split() if n)
_LOG = os.environ.get("GPU_CHECK_HIDE_LOG", "")


class _Hide:
    """Wraps one ``sys.meta_path`` finder: no spec for a hidden top-level module."""

    def __init__(self, finder) -> None:
        self.finder = finder

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top in _HIDDEN:
            if _LOG:
                with open(_LOG, "a") as log:
                    log.write(f"{fullname}\t{os.getpid()}\n")
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(fullname, path, target) if find is not None else None

    def invalidate_caches(self) -> None:
        if hasattr(self.finder, "invalidate_caches"):
            self.finder.invalidate_caches()

    def __getattr__(self, name):
        return getattr(self.finder, name)


if _HIDDEN:
    sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
    for _name in [m for m in sys.modules if m.partition(".")[0] in _HIDDEN]:
        del sys.modules[_name]
