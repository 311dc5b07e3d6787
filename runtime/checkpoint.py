"""Checkpoints of a run: what one holds, its atomic write, and the last complete one.

Owns the layout of ``<run>/checkpoints/version_<v>/`` (``v``: the policy version, i.e. the
steps trained so far) and the rule that a half-written checkpoint is never used:

* the trained models, as the train_step executors save them (the policy in ``transformers``
  format at the top, any other trained model, e.g. a critic, in a sub-folder named by it);
* ``trainer_state.pt`` (``torch.save``): ``version``; per train_step node its optimizer's
  ``state_dict`` (AdamW moments and step counts; the learning rate is constant, so there is
  no schedule state; ``None`` for a multi-rank train_step) and its world size; the trainer's
  (rank 0's) RNG states (torch, Python ``random``, numpy);
* ``trainer_dcp/`` (:data:`SHARDED_DIR`), for a train_step of several ranks: its model and
  optimizer shards as ``torch.distributed.checkpoint`` writes them (one ``.distcp`` file a
  rank and ``.metadata``), loaded on resume by any world size and strategy (``runtime.reshard``);
* ``manifest.json``, written last: ``version``, ``next_index`` (the first admission index
  not yet trained, ``v * B``: every group below it was trained exactly once, every group at
  or above it is admitted again under its index after a resume; the driver reads it here
  without loading the optimizer state), ``strategies`` (each train_step's plan strategy,
  e.g. ``d2``: a resume on another one reshards, ``runtime.reshard``) and every file's size in
  bytes. A folder counts as
  complete only when its manifest is there and every size matches.

The write goes to ``version_<v>.tmp``, every file and the folder are fsync'ed, then the
folder is renamed to ``version_<v>`` (``os.replace``: atomic on one file system) and the
parent fsync'ed. The generation replicas keep no state a checkpoint needs: their sampling
generator is re-seeded from ``(seed, replica, version)`` whenever they load a version
(:func:`sampling_seed`), and the dataset cursor is the admission index.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"
SHARDED_DIR = "trainer_dcp"
MANIFEST = "manifest.json"
PREFIX = "version_"


class ResumeError(ValueError):
    """A resume that cannot happen (no complete checkpoint, another run's folder or
    program); the message names the folder or the cause."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint folder and the policy version it holds."""

    folder: Path
    version: int

    def manifest(self) -> dict:
        """``manifest.json`` (module doc): ``version``, ``next_index``, ``files``."""
        return json.loads((self.folder / MANIFEST).read_text())


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
                     next_index: int, strategies: dict[str, str] | None = None) -> Path:
    """Write ``root/version_<version>`` atomically (module doc) and return it.

    Args:
        fill: writes the models into the folder it is given (the temporary one).
        state: the trainer state (module doc), saved as ``trainer_state.pt``.
        next_index: the first admission index not yet trained (the manifest's).
        strategies: each train_step's plan strategy (e.g. ``{"train_step": "d2"}``; the
            manifest's, read by a resume on another allocation, ``runtime.run_setup``).

    Raises:
        OSError: the folder cannot be written (names the path); nothing complete is left then.
    """
    final, tmp = root / f"{PREFIX}{version}", root / f"{PREFIX}{version}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    fill(tmp)
    torch.save(state, tmp / STATE_FILE)
    sizes = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync(path)
        sizes[str(path.relative_to(tmp))] = path.stat().st_size
    (tmp / MANIFEST).write_text(json.dumps({"version": version, "next_index": next_index, "strategies": strategies or {},
                                                "files": sizes}, indent=1))
    _fsync(tmp / MANIFEST)
    _fsync(tmp)
    if final.exists():  # left by an attempt that died after this version (never the one resumed from)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    return final


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds its manifest and every file it lists, at its size."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        return all((folder / name).stat().st_size == size for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The complete checkpoint of ``run_dir`` with the highest version (None when there is
    none); ``version_<v>.tmp`` folders and folders without a valid manifest are skipped."""
    found = []
    for folder in (run_dir / "checkpoints").glob(f"{PREFIX}*"):
        suffix = folder.name[len(PREFIX):]
        if suffix.isdigit() and folder.is_dir() and is_complete(folder):
            found.append(Checkpoint(folder, int(suffix)))
    return max(found, key=lambda c: c.version, default=None)


def resume_point(resume: str, run_dir: Path) -> Checkpoint | None:
    """The checkpoint a run in ``run_dir`` continues from, by the ``resume`` setting.

    ``""``: none (a new run). ``"auto"``: the latest complete checkpoint of ``run_dir``, or
    none. A folder: it must be ``run_dir`` and hold a complete checkpoint.

    Raises:
        ResumeError: the folder is not this run's (names both), or holds no complete checkpoint.
    """
    if not resume:
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    folder = Path(resume).resolve()
    if folder != run_dir.resolve():
        raise ResumeError(f"--resume {resume}: this plan writes to {run_dir} (out_dir and name); resume the run of "
                          f"that folder, or set out_dir/name to {folder.parent} / {folder.name}")
    found = latest_checkpoint(folder)
    if found is None:
        raise ResumeError(f"--resume {resume}: no complete checkpoint under {folder / 'checkpoints'} "
                          "(train.checkpoint_every > 0 writes them; resume=auto starts fresh instead)")
    return found
