"""Issue 26 (found by bench/chaos.py): a local attempt's ipc:// socket folder is removed when
the attempt stops, and one left by a SIGKILLed driver is swept by the next driver."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

from runtime.launch import LocalScheduler
from runtime.socket_dir import new_socket_dir


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_stale_folder_of_a_dead_driver_is_swept_and_a_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"areal-flow-{_dead_pid()}-abc"
    stale.mkdir()
    (stale / "train_step-0").write_text("")  # the socket file a killed worker left
    live = tmp_path / f"areal-flow-{os.getppid()}-def"  # a running process's folder
    live.mkdir()
    other = tmp_path / "areal-flow-notapid"  # not ours to judge
    other.mkdir()
    made = Path(new_socket_dir())
    assert not stale.exists() and live.is_dir() and other.is_dir()
    assert made.parent == tmp_path and made.name.startswith(f"areal-flow-{os.getpid()}-")
    assert oct(made.stat().st_mode & 0o777) == "0o700"


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
