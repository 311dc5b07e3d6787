"""Issue 26 (found by bench/chaos.py): a local attempt's ipc:// socket folder and a rank
launcher's folder of return values are removed by their owner, and one left by a SIGKILLed
owner is swept by the next owner of its kind (runtime.owned_dir)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime.launch import LocalScheduler
from runtime.owned_dir import RANKS, SOCKETS, new_owned_dir
from runtime.parallel.launch import spawn_workers


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("prefix", [SOCKETS, RANKS])
def test_a_stale_folder_of_a_dead_owner_is_swept_and_a_live_ones_kept(tmp_path, monkeypatch, prefix):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"{prefix}{_dead_pid()}-abc"
    stale.mkdir()
    (stale / "train_step-0").write_text("")  # the socket file (or rank's result) a killed process left
    live = tmp_path / f"{prefix}{os.getppid()}-def"  # a running process's folder
    live.mkdir()
    other = tmp_path / f"{prefix}notapid"  # not ours to judge
    other.mkdir()
    other_kind = tmp_path / f"{RANKS if prefix == SOCKETS else SOCKETS}{_dead_pid()}-ghi"
    other_kind.mkdir()  # a stale folder of the other kind: its own kind's next owner sweeps it
    made = Path(new_owned_dir(prefix))
    assert not stale.exists() and live.is_dir() and other.is_dir() and other_kind.is_dir()
    assert made.parent == tmp_path and made.name.startswith(f"{prefix}{os.getpid()}-")
    assert oct(made.stat().st_mode & 0o777) == "0o700"


def _rank_number(rank: int, world_size: int) -> int:
    return 10 * world_size + rank


def test_a_launcher_sweeps_the_folder_a_sigkilled_launcher_left_and_removes_its_own(tmp_path, monkeypatch):
    """Found by the 30-minute local chaos run: each driver kill left the trainer's rank launcher's
    folder (killed with its driver, no handler ran) in the run's temporary directory, nine in all."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    left = tmp_path / f"{RANKS}{_dead_pid()}-xyz"
    left.mkdir()
    (left / "rank0.pt").write_bytes(b"")
    assert spawn_workers(_rank_number, 1, backend="gloo") == [10]
    assert list(tmp_path.iterdir()) == []


def test_a_stopped_attempt_leaves_no_socket_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    topo = SimpleNamespace(groups={"train_step": SimpleNamespace(name="train_step", replicas=1, mesh=None)},
                           generation=SimpleNamespace(replicas=1), max_staleness=0)
    scheduler = LocalScheduler(SimpleNamespace(topo=topo, plan=SimpleNamespace(run={"scheduler": {}})))
    monkeypatch.setattr("runtime.launch._time_shared", lambda topo: [])
    addresses, control, _ = scheduler.addresses()
    first = Path(control[len("ipc://"):]).parent
    assert first.is_dir() and addresses["train_step"] == [f"ipc://{first}/train_step-0"]
    (first / "train_step-0").write_text("")  # a worker's socket, left as a SIGKILLed worker leaves it
    _, control, _ = scheduler.addresses()  # a restart's next attempt: the old folder goes
    assert not first.exists() and Path(control[len("ipc://"):]).parent.is_dir()
    scheduler.stop(wait=False)
    assert list(tmp_path.iterdir()) == []
