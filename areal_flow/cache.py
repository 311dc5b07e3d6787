"""The one on-disk cache root of areal-flow (warm starts, converted models).

Owns the location only: ``$AREAL_FLOW_CACHE`` if set, else ``$XDG_CACHE_HOME/areal_flow``,
else ``~/.cache/areal_flow`` (the XDG Base Directory default). Sub-folders are chosen by
their owners: ``sft/<key>/`` (``runtime.engines.sft``), ``models/<name>/``
(``areal_flow.models.hf``). Must not create, clean or size the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "AREAL_FLOW_CACHE"


def cache_root() -> Path:
    """The cache root, expanded (``~``) but not created.

    Order: ``$AREAL_FLOW_CACHE``; ``$XDG_CACHE_HOME/areal_flow``; ``~/.cache/areal_flow``.
    Empty variables count as unset (as the XDG specification says for ``XDG_CACHE_HOME``).
    """
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "areal_flow"
