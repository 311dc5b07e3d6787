"""How the processes of a run end together: the driver's stop signals, and the workers' tie
to the driver.

Owns two rules:

* **A stop signal is a Ctrl-C.** ``SIGTERM`` (what Slurm's ``scancel``, a Kubernetes pod stop
  or a Ray job stop send) and ``SIGHUP`` (the terminal closed) raise :class:`Stopped`, a
  ``KeyboardInterrupt``, in the driver's main thread while a run is executing
  (:func:`stop_signals_as_interrupt`), so they take the Ctrl-C path: the workers are stopped
  first, every step they reported is logged, and the last checkpoint is named.
* **A worker does not outlive its driver.** A local worker process asks the kernel for a
  ``SIGTERM`` when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``, :func:`die_with_parent`),
  so even a driver killed with ``SIGKILL`` (which no handler sees) leaves no worker computing
  or holding a device. (Ray actors end with their job; the multi-rank trainer's ranks do the
  same with their trainer process.)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from typing import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Stopped(KeyboardInterrupt):
    """The driver received a stop signal (``signum``); handled exactly like Ctrl-C.

    Attributes:
        signum: the signal's number; a command line exits with ``128 + signum``.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_stopped(signum: int, frame) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def stop_signals_as_interrupt() -> Iterator[None]:
    """For the ``with`` block, ``SIGTERM`` and ``SIGHUP`` raise :class:`Stopped` in the main
    thread; the previous handlers are restored after it. Outside the main thread (where Python
    cannot install handlers) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_stopped) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def die_with_parent(parent_pid: int | None, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; elsewhere a
    no-op). If the parent ``parent_pid`` died before the request took effect (this process was
    already re-parented), this process sends ``sig`` to itself now.

    Args:
        parent_pid: the pid of the process that started this one (``None``: not checked).
    """
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
