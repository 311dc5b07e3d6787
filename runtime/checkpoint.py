"""Checkpoints of a run: what one holds, its atomic write, and the last complete one.

Owns the layout of ``<run>/checkpoints/version_<v>/`` (``v``: the policy version, i.e. the
steps trained so far) and the rule that a half-written checkpoint is never used:

* the trained models, as the train_step executors save them (the policy in ``transformers``
  format at the top, any other trained model, e.g. a critic, in a sub-folder named by it);
* ``trainer_state.pt`` (``torch.save``): ``version``; per train_step node its optimizer's
  ``state_dict`` (AdamW moments and step counts; the learning rate is constant, so there is
  no schedule state; ``None`` for a multi-rank train_step) and its world size; the trainer's
  (rank 0's) RNG states (torch, Python ``random``, numpy); ``executors``: per batch node
  whose executor is ``areal_flow.ops.interfaces.Checkpointed``, its ``checkpoint_state()``;
* ``trainer_dcp/`` (:data:`SHARDED_DIR`), for a train_step of several ranks: its model and
  optimizer shards as ``torch.distributed.checkpoint`` writes them (one ``.distcp`` file a
  rank and ``.metadata``), loaded on resume by any world size and strategy (``runtime.reshard``);
* ``manifest.json``, written last: ``version``, ``next_index`` (the first admission index
  not yet trained, ``v * B``: every group below it was trained exactly once, every group at
  or above it is admitted again under its index after a resume; the driver reads it here
  without loading the optimizer state), ``strategies`` (each train_step's plan strategy,
  e.g. ``d2``: a resume on another one reshards, ``runtime.reshard``), every file's size in
  bytes and xxHash64 (``files``: ``{path: {"bytes", "xxh64"}}``), and ``manifest_xxh64``, the
  xxHash64 of the rest (its JSON with sorted keys), so a changed manifest is caught too.

A plan with several step groups (a chain, ``compiler.hosting``: e.g. a critic on a mesh of
its own) checkpoints each group's *part* at the same version, each written by its own group
as above: the policy trainer's group (``Topology.trainer``) writes ``version_<v>/`` and lists
the other groups in its manifest (``parts``: their names, in chain order; absent for one
step group, whose format is the one above); every other group writes
``parts/<group>/version_<v>/`` (:func:`part_folder`), with its own models (a sub-folder
named by each), ``trainer_state.pt`` and manifest. Version ``v`` is complete only when
``version_<v>/`` and every part it lists are.

A folder counts as complete only when its manifest parses, its own checksum holds, its
``version`` is the folder's, and every file it lists is there at its size and checksum, and a
version only when its parts are too (``runtime.checkpoint_integrity``: ``torn``,
``incomplete``). A resume takes the newest complete version and names each newer one it
skips and why (:func:`latest_checkpoint`).

The write goes to ``version_<v>.tmp``, every file and the folder are fsync'ed, then the
folder is renamed to ``version_<v>`` (``os.replace``: atomic on one file system) and the
parent fsync'ed. A write that fails (a full disk: ``ENOSPC``) removes the ``.tmp`` folder and
raises :class:`CheckpointWriteError`, leaving every complete checkpoint as it was; only after
a new one is complete are old ones rotated (:func:`rotate`, ``train.keep_checkpoints``; in a
chain by whichever group completes the version last, every part with its version).

The generation replicas keep no state a checkpoint needs: their sampling generator is
re-seeded from ``(seed, replica, version)`` whenever they load a version
(:func:`sampling_seed`), the dataset cursor is the admission index, and a resampled slot's
prompt is a function of the slot (``runtime.spares``).
"""

from __future__ import annotations

import errno
import io
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime.checkpoint_integrity import (MANIFEST, PARTS_DIR, PREFIX, incomplete, manifest_digest, part_folder,
                                          versions, xxh64)

STATE_FILE = "trainer_state.pt"
SHARDED_DIR = "trainer_dcp"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a quota, an I/O error); its ``.tmp``
    folder was removed and the complete checkpoints are untouched. The message names the
    folder and the cause (its ``errno`` name); ``errno`` is the cause's."""

    def __str__(self) -> str:
        return self.strerror


class ResumeError(ValueError):
    """A resume that cannot happen (no complete checkpoint, another run's folder or
    program); the message names the folder or the cause."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint folder and the policy version it holds."""

    folder: Path
    version: int

    def manifest(self) -> dict:
        """``manifest.json`` (module doc): ``version``, ``next_index``, ``strategies``, ``files``
        (and ``parts`` in a chain)."""
        return json.loads((self.folder / MANIFEST).read_text())

    def strategies(self) -> dict[str, str]:
        """Each train_step's plan strategy, over the folder's manifest and its parts'."""
        manifest = self.manifest()
        out = dict(manifest.get("strategies", {}))
        for group in manifest.get("parts", []):
            out.update(json.loads((part_folder(self.folder, group) / MANIFEST).read_text()).get("strategies", {}))
        return out


def read_state(folder: Path) -> dict:
    """The ``trainer_state.pt`` of checkpoint ``folder`` (module doc; a file this run wrote).

    Raises:
        FileNotFoundError: ``folder`` holds none.
    """
    return torch.load(folder / STATE_FILE, weights_only=False)


def model_folder(checkpoint: Path, model: str, policy: str) -> Path:
    """Where a checkpoint holds trained ``model``: the folder itself for the policy, a
    sub-folder named by the model otherwise."""
    return checkpoint if model == policy else checkpoint / model


def sampling_seed(seed: int, replica: int, version: int) -> int:
    """The seed of a replica's sampling generator once it holds policy ``version``: numpy's
    ``SeedSequence([seed, replica, version])`` (independent streams per replica and version),
    so what a replica samples at a version does not depend on what it sampled before."""
    return int(np.random.SeedSequence([seed, replica, version]).generate_state(1, np.uint64)[0] >> 1)


def capture_rng() -> dict:
    """The RNG states of this process: torch (CPU, and CUDA when present), Python ``random``, numpy."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Set this process's RNGs to ``state`` (from :func:`capture_rng`)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(root: Path, version: int, fill: Callable[[Path], None], state: dict,
                     next_index: int, strategies: dict[str, str] | None = None,
                     parts: tuple[str, ...] = ()) -> Path:
    """Write ``root/version_<version>`` atomically (module doc) and return it.

    Args:
        fill: writes the models into the folder it is given (the temporary one).
        state: the trainer state (module doc), saved as ``trainer_state.pt``.
        next_index: the first admission index not yet trained (the manifest's).
        strategies: each train_step's plan strategy (e.g. ``{"train_step": "d2"}``; the
            manifest's, read by a resume on another allocation, ``runtime.run_setup``).
        parts: the other step groups of a chain, whose parts complete this version (the
            manifest's ``parts``, only when given: module doc).

    Raises:
        CheckpointWriteError: an ``OSError`` while writing (e.g. ``ENOSPC``); the ``.tmp``
            folder is removed and nothing else changed. Any other exception ``fill`` raises
            propagates after the same removal.
    """
    final, tmp = root / f"{PREFIX}{version}", root / f"{PREFIX}{version}.tmp"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        fill(tmp)
        buffer = io.BytesIO()  # written with a plain write: a full disk raises OSError (torch's writer: RuntimeError)
        torch.save(state, buffer)
        (tmp / STATE_FILE).write_bytes(buffer.getbuffer())
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync(path)
            files[str(path.relative_to(tmp))] = {"bytes": path.stat().st_size, "xxh64": xxh64(path)}
        body = {"version": version, "next_index": next_index, "strategies": strategies or {}, "files": files,
                **({"parts": list(parts)} if parts else {})}
        (tmp / MANIFEST).write_text(json.dumps({**body, "manifest_xxh64": manifest_digest(body)}, indent=1))
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}" if e.errno else str(e)
        raise CheckpointWriteError(e.errno, f"checkpoint {final} not written ({cause}); removed {tmp.name}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # left by an attempt that died after this version (never the one resumed from)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    return final


def rotate(root: Path, version: int, keep: int) -> list[Path]:
    """After ``version_<version>`` is complete, delete the ``version_<v>`` folders of ``root``
    with ``v < version`` beyond the ``keep - 1`` newest complete ones (by manifest and sizes,
    parts included: ``incomplete``), so ``keep`` complete checkpoints remain, and every
    part folder (``parts/<group>/version_<v>``, ``v < version``) of a version not kept;
    ``keep = 0`` keeps all. A ``version`` not complete yet (a chain's part still to come)
    deletes nothing: the group completing it rotates. Newer folders (left by an attempt that
    died after its resume point) are not touched. Two groups rotating at once delete each
    folder once between them. Returns the folders deleted here.

    Raises:
        OSError: a folder cannot be deleted (names it).
    """
    if keep <= 0 or incomplete(root / f"{PREFIX}{version}", checksums=False) is not None:
        return []
    kept, doomed = {version}, []
    for v, folder in versions(root):
        if v >= version:
            continue
        if len(kept) < keep and incomplete(folder, checksums=False) is None:
            kept.add(v)
            continue
        doomed += _delete(folder, keep)
    groups = sorted(p for p in (root / PARTS_DIR).iterdir() if p.is_dir()) if (root / PARTS_DIR).is_dir() else []
    for group in groups:
        for v, folder in versions(group):
            if v < version and v not in kept:
                doomed += _delete(folder, keep)
    return doomed


def _delete(folder: Path, keep: int) -> list[Path]:
    """``[folder]`` once deleted, ``[]`` when another group's rotation deleted it first.

    Raises:
        OSError: it cannot be deleted (names it and ``keep``)."""
    try:
        shutil.rmtree(folder)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise OSError(f"cannot delete the old checkpoint {folder} (train.keep_checkpoints={keep}): {e}") from e
    return [folder]


def _size(folder: Path | None) -> int:
    """Bytes the checkpoint ``folder`` holds, by its manifest; 0 when unknown (None, or no
    readable manifest)."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"].values()
        return sum(entry if isinstance(entry, int) else entry["bytes"] for entry in files)  # sizes only: older manifests
    except (TypeError, OSError, ValueError, KeyError):
        return 0


def save_checkpoint(root: Path, version: int, fill: Callable[[Path], None], state: dict, *, next_index: int,
                    strategies: dict[str, str], keep: int, last: Path | None,
                    say: Callable[[str], None], part: str | None = None,
                    parts: tuple[str, ...] = ()) -> Path | None:
    """:func:`write_checkpoint`, then :func:`rotate` by ``keep`` (``train.keep_checkpoints``).

    In a chain (module doc) ``part`` names the step group writing its part, under
    ``root/parts/<part>`` (None: the policy trainer's group, at ``root``), and ``parts`` are
    the other groups the trainer's manifest lists.

    A checkpoint that cannot be written does not stop training: it is said in one line to
    ``say``, naming the folder, the cause and ``last`` (the newest complete checkpoint, None:
    none yet), which stays as it was, and None is returned; a run on a disk that stays full
    stops when it writes its final model. Two causes: the file system has fewer bytes free
    than ``last`` holds (its manifest's sizes; the write is not tried, so it cannot fill the
    disk under the run's other files), or the write fails with an ``OSError``
    (:class:`CheckpointWriteError`: a full disk, a quota). Returns the written folder otherwise.
    """
    try:
        where = root / PARTS_DIR / part if part else root
        need = _size(last)
        free = shutil.disk_usage(root).free if need else 0
        if need > free:
            raise CheckpointWriteError(errno.ENOSPC, f"checkpoint {where / f'{PREFIX}{version}'} not written (ENOSPC: "
                                       f"{need / 2**20:.1f} MiB needed, as {last.name} holds, {free / 2**20:.1f} "
                                       "MiB free)")
        final = write_checkpoint(where, version, fill, state, next_index, strategies, parts)
    except CheckpointWriteError as e:
        kept = f"{last} stays the last complete checkpoint" if last else "no complete checkpoint yet"
        say(f"{e.strerror}; {kept}; training goes on")
        return None
    rotate(root, version, keep)
    return final


def latest_checkpoint(run_dir: Path, say: Callable[[str], None] | None = None) -> Checkpoint | None:
    """The complete checkpoint of ``run_dir`` with the highest version, parts included in a
    chain (None when there is none); ``version_<v>.tmp`` folders are ignored and incomplete
    ones (``incomplete``) skipped, each named with its reason in one line to ``say``
    (e.g. ``print`` to stderr)."""
    for version, folder in versions(run_dir / "checkpoints"):
        why = incomplete(folder)
        if why is None:
            return Checkpoint(folder, version)
        if say is not None:
            say(f"skipping checkpoint {folder}: {why}; falling back to the one before")
    return None


def resume_point(resume: str, run_dir: Path, say: Callable[[str], None] | None = None) -> Checkpoint | None:
    """The checkpoint a run in ``run_dir`` continues from, by the ``resume`` setting.

    ``""``: none (a new run). ``"auto"``: the latest complete checkpoint of ``run_dir``, or
    none. A folder: it must be ``run_dir`` and hold a complete checkpoint. Torn checkpoints
    skipped on the way are named to ``say`` (:func:`latest_checkpoint`).

    Raises:
        ResumeError: the folder is not this run's (names both), or holds no complete checkpoint.
    """
    if not resume:
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir, say)
    folder = Path(resume).resolve()
    if folder != run_dir.resolve():
        raise ResumeError(f"--resume {resume}: this plan writes to {run_dir} (out_dir and name); resume the run of "
                          f"that folder, or set out_dir/name to {folder.parent} / {folder.name}")
    found = latest_checkpoint(folder, say)
    if found is None:
        raise ResumeError(f"--resume {resume}: no complete checkpoint under {folder / 'checkpoints'} "
                          "(train.checkpoint_every > 0 writes them; resume=auto starts fresh instead)")
    return found
