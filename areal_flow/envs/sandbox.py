"""Run untrusted Python (a policy's tool call) in a separate, limited process.

Owns :func:`run_python`: the code runs in a fresh ``python -I`` child (isolated mode: no
user site, no ``PYTHON*`` variables, the script's folder not on ``sys.path``) in a new
temporary folder, deleted afterwards, with a minimal environment. Before the code runs,
the child sets ``resource.setrlimit`` (POSIX; Linux here) on itself:

=================  ===============================================================
``RLIMIT_AS``      address space, ``memory_mb`` MiB: a huge allocation raises MemoryError
``RLIMIT_CPU``     CPU seconds, ``cpu_s`` (SIGXCPU, then SIGKILL one second later)
``RLIMIT_FSIZE``   largest file it may write, ``max_file_bytes`` (SIGXFSZ ignored, so
                   the write fails with OSError); stdout and stderr are such files
``RLIMIT_NOFILE``  64 open files
``RLIMIT_NPROC``   ``max_processes`` new processes or threads (0: ``fork`` and
                   thread creation fail)
``RLIMIT_CORE``    0 (no core dumps)
=================  ===============================================================

Started as root, the child also drops to uid/gid 65534 (``nobody``) with no
supplementary groups: the kernel does not apply ``RLIMIT_NPROC`` to root (not in a user
namespace either, measured here), and ``nobody`` cannot write where only root can. It
imports the ``preload`` modules first (default :data:`PRELOAD`): as ``nobody`` it can import
only what ``nobody`` may read (here the interpreter lives under ``/root``, mode 700, so
an import of anything else fails with an ImportError: numpy and sympy do). Not root,
``RLIMIT_NPROC`` counts every process and thread of the user (the trainer's too), so the
limit is set to the user's count at start plus ``max_processes``.

The parent waits ``timeout_s`` wall-clock seconds, then kills the child's process group
(``start_new_session``: the child leads its own group) with SIGKILL; it kills the group
after a normal exit too, so no background child outlives the call. Only the first
``max_output`` bytes of stdout and stderr are read back.

What is *not* isolated (use a container or a VM for untrusted code beyond a policy's
arithmetic): the file system (the code can read whatever its user can read, and, when not
dropped to ``nobody``, write it: anywhere its user may write, each file at most
``max_file_bytes``); the network, unless ``isolate_network`` and ``unshare -n`` (``-rn``
when not root) work on this machine, which puts the child in an empty network namespace
(``SandboxResult.network_isolated`` says whether it did); signals: the code may signal
any process of its uid (not root: the trainer's own processes; as ``nobody``: the other
calls running at the same time, whose folders it may also read, all being ``nobody``'s);
a process that calls ``setsid``
leaves the group that is killed (``RLIMIT_NPROC`` bounds how many can); the rate of disk
and CPU use within the limits; kernel exploits.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

NOBODY = 65534
"""uid and gid a child started as root runs the code as."""
PRELOAD = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "statistics", "random",
           "re", "string", "operator", "heapq", "bisect", "json")
"""Modules the child imports before it drops to ``nobody`` (module doc), so the code can use
them even when the interpreter's files are readable by root only."""

_BOOTSTRAP = r"""
import json, os, resource, signal, sys
lim = json.loads(sys.argv[1])
def count_tasks(uid):
    n = 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields["Threads"])
        except (OSError, ValueError, KeyError):
            pass
    return n
for name in lim["preload"]:
    try:
        __import__(name)
    except Exception:
        pass
if os.geteuid() == 0:
    try:
        os.setgroups([]); os.setgid(lim["nobody"]); os.setuid(lim["nobody"])
    except OSError:
        pass
nproc = lim["max_processes"] + (count_tasks(os.getuid()) if os.getuid() != lim["nobody"] else 0)
for key, soft, hard in (("RLIMIT_AS", lim["as"], lim["as"]), ("RLIMIT_CPU", lim["cpu"], lim["cpu"] + 1),
                        ("RLIMIT_FSIZE", lim["fsize"], lim["fsize"]), ("RLIMIT_NOFILE", 64, 64),
                        ("RLIMIT_NPROC", nproc, nproc), ("RLIMIT_CORE", 0, 0)):
    resource.setrlimit(getattr(resource, key), (soft, hard))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
del json, resource, signal, count_tasks, lim, nproc, name
sys.argv = ["main.py"]
with open("main.py") as f:
    code = compile(f.read(), "main.py", "exec")
exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass
class SandboxResult:
    """What one :func:`run_python` call did.

    Attributes:
        stdout / stderr: the first ``max_output`` bytes of each, decoded (UTF-8, errors replaced).
        exit_code: the child's return code (negative: killed by that signal); None when killed
            at the timeout.
        timed_out: the wall-clock limit ran out and the group was killed.
        truncated: stdout or stderr was longer than ``max_output`` bytes.
        network_isolated: the child ran in an empty network namespace.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    network_isolated: bool

    def observation(self, timeout_s: float) -> str:
        """One text for the policy: stdout, then stderr, then why it stopped when not a clean
        exit (``"error: timed out after 5 s (killed)"``, ``"error: killed by SIGXCPU (CPU
        limit)"``, ``"error: exit code 1"``); ``"(no output)"`` when all is empty."""
        parts = [p.rstrip("\n") for p in (self.stdout, self.stderr) if p.strip()]
        if self.truncated:
            parts.append("[output truncated]")
        if self.timed_out:
            parts.append(f"error: timed out after {timeout_s:g} s (killed)")
        elif self.exit_code and self.exit_code < 0:
            name = signal.Signals(-self.exit_code).name if -self.exit_code in signal.valid_signals() else "a signal"
            why = {"SIGXCPU": " (CPU limit)", "SIGKILL": " (a limit)"}.get(name, "")
            parts.append(f"error: killed by {name}{why}")
        elif self.exit_code:
            parts.append(f"error: exit code {self.exit_code}")
        return "\n".join(parts) if parts else "(no output)"


@functools.lru_cache(maxsize=1)
def _unshare_prefix() -> tuple[str, ...]:
    """``("unshare", "-n")`` (root) or ``("unshare", "-rn")`` when it works here, else ``()``."""
    prefix = ("unshare", "-n") if os.geteuid() == 0 else ("unshare", "-rn")
    if shutil.which("unshare") is None:
        return ()
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return prefix if ok else ()


def run_python(code: str, *, timeout_s: float = 5.0, cpu_s: int = 5, memory_mb: int = 512,
               max_output: int = 2000, max_file_bytes: int = 1 << 20, max_processes: int = 0,
               isolate_network: bool = True, preload: tuple[str, ...] = PRELOAD) -> SandboxResult:
    """Run ``code`` as a script in a limited child process (module doc); never raises for
    anything the code does.

    Args:
        code: Python source, run as ``main.py`` in a fresh temporary folder (the cwd).
        timeout_s: wall-clock seconds before the process group is killed.
        cpu_s: CPU seconds (``RLIMIT_CPU``), whole seconds >= 1.
        memory_mb: address space, MiB (``RLIMIT_AS``; the interpreter itself takes ~30 MiB).
        max_output: bytes of stdout and of stderr read back.
        max_file_bytes: largest file the code may write, bytes (``RLIMIT_FSIZE``), stdout
            and stderr included.
        max_processes: processes or threads the code may start (``RLIMIT_NPROC``).
        isolate_network: run in an empty network namespace when ``unshare`` allows it.
        preload: modules imported before the code runs (and before the drop to ``nobody``).

    Returns:
        a :class:`SandboxResult`.

    Raises:
        ValueError: a limit out of range (``timeout_s`` or ``memory_mb`` <= 0, ``cpu_s`` < 1,
            ``max_output`` < 0, ``max_processes`` < 0).
        OSError: the child could not be started (no temporary folder, no ``sys.executable``).
    """
    if timeout_s <= 0 or memory_mb <= 0 or int(cpu_s) < 1 or max_output < 0 or max_processes < 0:
        raise ValueError(f"run_python: bad limits timeout_s={timeout_s}, cpu_s={cpu_s}, memory_mb={memory_mb}, "
                         f"max_output={max_output}, max_processes={max_processes}")
    limits = {"as": int(memory_mb) << 20, "cpu": int(cpu_s), "fsize": int(max_file_bytes),
              "max_processes": int(max_processes), "nobody": NOBODY,
              "preload": [str(m) for m in preload]}
    folder = tempfile.mkdtemp(prefix="areal-python-")
    try:
        with open(os.path.join(folder, "main.py"), "w", encoding="utf-8") as f:
            f.write(str(code))
        if os.geteuid() == 0:
            os.chmod(folder, 0o700)
            for path in (folder, os.path.join(folder, "main.py")):
                os.chown(path, NOBODY, NOBODY)
        prefix = _unshare_prefix() if isolate_network else ()
        env = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(os.path.join(folder, ".stdout"), "wb+") as out, open(os.path.join(folder, ".stderr"), "wb+") as err:
            if os.geteuid() == 0:
                os.chown(out.name, NOBODY, NOBODY)
                os.chown(err.name, NOBODY, NOBODY)
            proc = subprocess.Popen([*prefix, sys.executable, "-I", "-c", _BOOTSTRAP, json.dumps(limits)], cwd=folder,
                                    env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, close_fds=True,
                                    start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc.pid)
            proc.wait()
            texts, truncated = [], False
            for f in (out, err):
                f.seek(0)
                data = f.read(max_output + 1)
                truncated |= len(data) > max_output
                texts.append(data[:max_output].decode("utf-8", errors="replace"))
        return SandboxResult(texts[0], texts[1], None if timed_out else proc.returncode, timed_out, truncated,
                             bool(prefix))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid`` (none left is fine)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
