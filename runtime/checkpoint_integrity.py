"""Whether a checkpoint folder is complete: its manifest's checksums and sizes, and a chain's parts.

The layout (``version_<v>/``, ``manifest.json``, ``parts/<group>/version_<v>/``) and the
atomic write are ``runtime.checkpoint``'s. A folder counts as complete only when its
manifest parses, its own checksum (``manifest_xxh64``) holds, its ``version`` is the
folder's, and every file it lists is there at its size and xxHash64 (:func:`torn` says why
not). In a chain (several step groups) version ``v`` is complete only when ``version_<v>/``
and every part its manifest lists are (:func:`incomplete`).
"""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

MANIFEST = "manifest.json"
PREFIX = "version_"
PARTS_DIR = "parts"


def part_folder(checkpoint: Path, group: str) -> Path:
    """Where step group ``group``'s part of checkpoint ``checkpoint`` (``<root>/version_<v>``)
    lies in a chain (module doc): ``<root>/parts/<group>/version_<v>``."""
    return checkpoint.parent / PARTS_DIR / group / checkpoint.name


def xxh64(path: Path) -> str:
    """Hex xxHash64 of the file at ``path`` (read in 4 MiB chunks)."""
    h = xxhash.xxh64()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def manifest_digest(body: dict) -> str:
    """Hex xxHash64 of a manifest without its ``manifest_xxh64`` (JSON, sorted keys)."""
    return xxhash.xxh64(json.dumps(body, sort_keys=True).encode()).hexdigest()


def torn(folder: Path, checksums: bool = True) -> str | None:
    """Why ``folder`` is not a complete checkpoint (module doc), in a few words naming the
    file; None when it is. ``checksums=False`` checks the manifest and the sizes only
    (cheap: no file is read)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError) as e:  # ValueError: not UTF-8 or not JSON
        return f"{MANIFEST} unreadable ({type(e).__name__})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return f"{MANIFEST} is not a checkpoint manifest"
    body = {k: v for k, v in manifest.items() if k != "manifest_xxh64"}
    if "manifest_xxh64" not in manifest and all(isinstance(v, int) for v in manifest["files"].values()):
        manifest["files"] = {name: {"bytes": size} for name, size in manifest["files"].items()}
        checksums = False  # written before checksums were kept (sizes only): checked as it was then
    elif manifest.get("manifest_xxh64") != manifest_digest(body):
        return f"{MANIFEST} fails its checksum"
    if folder.name != f"{PREFIX}{manifest.get('version')}":
        return f"{MANIFEST} is version {manifest.get('version')}'s"
    for name, entry in manifest["files"].items():
        path = folder / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != entry["bytes"]:
            return f"{name} is {size} bytes, the manifest says {entry['bytes']}"
        try:
            if checksums and xxh64(path) != entry["xxh64"]:
                return f"{name} fails its xxh64 checksum"
        except OSError as e:  # deleted meanwhile (a rotation), or a disk error
            return f"{name} unreadable ({e.strerror or e})"
    return None


def versions(root: Path) -> list[tuple[int, Path]]:
    """``(v, folder)`` of every ``version_<v>`` folder of ``root`` (no ``.tmp``), newest first."""
    found = [(int(f.name[len(PREFIX):]), f) for f in root.glob(f"{PREFIX}*")
             if f.name[len(PREFIX):].isdigit() and f.is_dir()]
    return sorted(found, reverse=True)


def incomplete(folder: Path, checksums: bool = True) -> str | None:
    """Why version folder ``folder`` is not complete with the parts its manifest lists (module
    doc): :func:`torn` of the folder, or ``its part parts/<group>/version_<v>: <why>`` for the
    first torn part; None when all are complete. ``checksums`` as for :func:`torn`."""
    why = torn(folder, checksums)
    if why is not None:
        return why
    try:
        groups = json.loads((folder / MANIFEST).read_text()).get("parts", [])
    except OSError:  # deleted meanwhile, by a rotation
        return f"no {MANIFEST}"
    for group in groups:
        part = part_folder(folder, group)
        why = torn(part, checksums)
        if why is not None:
            return f"its part {part.relative_to(folder.parent)}: {why}"
    return None
