"""The envs shipped with areal-flow, and the lookups that see them.

Owns ``env_class`` / ``make_env``: importing this module registers the shipped envs
(``@register_env`` in their modules) before any lookup; ``base.py`` imports none of them.
"""

from __future__ import annotations

import difflib

from areal_flow.envs import guess_number, python_math, support_desk  # noqa: F401  (@register_env on import)
from areal_flow.envs.base import _ENVS, BaseEnv, EnvError


def env_class(name: str) -> type:
    """The class registered as ``name`` (shipped or registered by a user's module).

    Raises:
        EnvError: no env has that name (nearest names listed).
    """
    if name not in _ENVS:
        close = difflib.get_close_matches(name, list(_ENVS), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; registered: {', '.join(sorted(_ENVS))}"
        raise EnvError(f"unknown env {name!r}{hint} (register one with @register_env)")
    return _ENVS[name]


def make_env(name: str, config: dict) -> BaseEnv:
    """A fresh instance of env ``name`` for one episode (``config``: see ``BaseEnv.config``)."""
    return env_class(name)(config)
