"""Issue 26: SIGTERM / SIGHUP are handled like Ctrl-C, and no worker outlives its driver, even a
SIGKILLed one (runtime.lifecycle)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from runtime.lifecycle import Stopped, die_with_parent, stop_signals_as_interrupt

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_raises_a_keyboard_interrupt_naming_it_and_the_old_handler_comes_back(sig):
    before = signal.getsignal(sig)
    with pytest.raises(KeyboardInterrupt) as stopped:
        with stop_signals_as_interrupt():
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler runs at the next bytecode boundary; never reached
    assert isinstance(stopped.value, Stopped) and stopped.value.signum == sig
    assert signal.getsignal(sig) is before


def test_a_process_that_asked_dies_with_its_parent_even_a_sigkilled_one():
    child = ("import os, sys, time; from runtime.lifecycle import die_with_parent; "
             "die_with_parent(os.getppid()); print(os.getpid(), flush=True); time.sleep(120)")
    parent = ("import subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=sys.stdout); time.sleep(120)")
    middle = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    grandchild = psutil.Process(int(middle.stdout.readline()))
    assert grandchild.is_running()
    middle.kill()  # SIGKILL: no handler of the parent runs
    middle.wait(10)
    grandchild.wait(timeout=10)  # psutil.TimeoutExpired if it kept running


def test_an_orphan_that_asks_too_late_signals_itself():
    code = ("import os, signal, time; from runtime.lifecycle import die_with_parent; "
            "die_with_parent(os.getppid() + 1, signal.SIGUSR1); time.sleep(30)")  # not its parent: died already
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=REPO, timeout=30)
    assert proc.returncode == -signal.SIGUSR1


def _sleep_rank(rank: int, world_size: int) -> None:
    """A rank's work that outlasts the test: only its launcher's death can end it in time."""
    time.sleep(600)


def test_ranks_whose_launcher_died_while_they_started_end_on_their_own():
    """The launcher (``spawn_workers``, as a trainer starts its ranks) exits 1 s after spawning,
    while its two ranks are still importing, before they could ask for a parent-death signal.
    Found by bench/chaos.py (a driver killed at start-up left the ranks in the rendezvous for
    its timeout); a rank's entry now checks its parent, so both end within the import time."""
    mark = f"rank-orphans-{os.getpid()}-{time.time_ns()}"
    launcher = ("import multiprocessing as mp, os, sys, threading; sys.path.insert(0, 'tests'); "
                "from test_lifecycle import _sleep_rank; from runtime.parallel.launch import spawn_workers; "
                "threading.Timer(1.0, lambda: (print(*[c.pid for c in mp.active_children()], flush=True), "
                "os._exit(0))).start(); spawn_workers(_sleep_rank, 2, timeout_s=600)")
    done = subprocess.run([sys.executable, "-c", launcher], env={**ENV, "RANK_ORPHANS_MARK": mark}, cwd=REPO,
                          timeout=120, capture_output=True, text=True)

    def orphans() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("RANK_ORPHANS_MARK") == mark and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.Error:
                continue
        return found

    # both ranks were started (whether they are still importing now, or already ended on their own)
    assert len(done.stdout.split()) == 2, (done.stdout, done.stderr[-2000:])
    deadline = time.monotonic() + 90
    while (left := orphans()) and time.monotonic() < deadline:
        time.sleep(0.5)
    described = []
    for p in left:
        with contextlib.suppress(psutil.Error):
            described.append(" ".join(p.cmdline())[:120])
            p.kill()
    assert not left, described


RUN = ["train.steps=200", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false",
       "train.checkpoint_every=1"]


def _start(tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """``areal-flow run`` of the main graph in a subprocess; returns it once its first checkpoint
    is written (its workers are then all running)."""
    proc = subprocess.Popen([sys.executable, "-m", "areal_flow.cli", "run", "graphs/arith_grpo.py", *RUN,
                             f"out_dir={tmp_path}", f"name={name}"], cwd=REPO, env=ENV, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    first = tmp_path / name / "checkpoints" / "version_1"
    deadline = time.monotonic() + 900  # start-up is a minute or two on a loaded 2-core machine
    while not first.is_dir():
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "no checkpoint within 900 s"
        time.sleep(0.2)
    return proc, tmp_path / name


@pytest.mark.slow
def test_sigterm_stops_the_run_like_ctrl_c_and_leaves_nothing_running(tmp_path, warm_cache):
    proc, out = _start(tmp_path, "term")
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert len(workers) >= 2  # generation replica and trainer at least
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    line = next(x for x in err.splitlines() if "interrupted after" in x)
    assert f"--resume {out} continues from it" in line and "of 200 steps; last checkpoint:" in line
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, [p.cmdline() for p in alive]


@pytest.mark.slow
@pytest.mark.ci
def test_a_sigkilled_driver_leaves_no_worker_running(tmp_path, warm_cache):
    proc, _ = _start(tmp_path, "kill")
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "resource_tracker" not in
               " ".join(p.cmdline())]
    assert len(workers) >= 2
    proc.kill()
    proc.wait(10)
    gone, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, [p.cmdline() for p in alive]
