"""The embedded engine's fused CPU kernels: builds ``csrc/*.cpp`` once per machine and loads them
as ``torch.ops.areal_flow``: ``decode_attention``, ``add_rms_norm``, ``rope``, ``silu_mul``, ``sample``,
``pack_lm_head`` / ``lm_head`` (the mixed bf16 product: the LM head, and a bf16 engine's layers where it runs on
AVX-512 BF16) and ``mixed_product_isa``.

Owns building and loading; the decoder (``runtime.engines.decoder``) decides when to call them
(``gen.cpu_kernels``). The build uses ``torch.utils.cpp_extension.load`` (ninja and the system
C++ compiler; `torch docs <https://pytorch.org/docs/stable/cpp_extension.html>`_) with ``-O3
-march=native``, into torch's extension folder (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``); the name carries a hash of the sources, the torch version and the
CPU's feature flags, so another CPU or source never loads a stale build. The first build took
~25 s on this 2-core machine; later processes load it in well under a second. Concurrent
builders wait on torch's lock file; a lock older than ``STALE_LOCK_S`` is a killed builder's
(torch waits on it forever) and is removed first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "decode_attention.cpp", CSRC / "layer_kernels.cpp", CSRC / "sampling.cpp", CSRC / "lm_head.cpp")
_HEADERS = (CSRC / "vec16.h",)
MARCH_ENV = "AREAL_FLOW_KERNEL_MARCH"
"""Environment variable: the ``-march`` of the build (default ``native``); the tests build
``x86-64-v3`` (no AVX-512) too, to run the kernels' portable paths."""
_LDFLAGS = ["-fopenmp"]
STALE_LOCK_S = 600.0
"""Seconds after which a build's lock file is taken for a killed builder's (a build takes ~25 s)."""
log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[str, object] = {}


def _cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``), or the platform's processor name elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _flags() -> list[str]:
    return ["-O3", f"-march={os.environ.get(MARCH_ENV, 'native')}", "-fopenmp"]


def build_name() -> str:
    """The extension's name: sources, torch version, flags and CPU features hashed (16 hex digits)."""
    h = hashlib.sha256()
    for path in (*SOURCES, *_HEADERS):
        h.update(path.read_bytes())
    for part in (torch.__version__, " ".join(_flags() + _LDFLAGS), _cpu_flags()):
        h.update(part.encode())
    return f"areal_flow_cpu_kernels_{h.hexdigest()[:16]}"


def load():
    """Build (first use on a machine) and load the kernels; returns ``torch.ops.areal_flow``, whose
    ops take CPU, contiguous, fp32 or bf16 tensors (shapes in each ``csrc`` file's header).

    Raises:
        RuntimeError: the build or load failed (no C++ compiler, no ninja, a compile error);
            the message carries the cause. A failure is remembered: later calls raise at once.
    """
    with _lock:
        if "ops" in _loaded:
            return _loaded["ops"]
        if "error" in _loaded:
            raise RuntimeError(_loaded["error"])
        try:
            from torch.utils import cpp_extension

            folder = Path(cpp_extension._get_build_directory(build_name(), False))
            lock = folder / "lock"
            if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
                log.warning("removing %s, a CPU-kernel build's lock older than %.0f s (its builder died)", lock,
                            STALE_LOCK_S)
                lock.unlink(missing_ok=True)
            if not any(folder.glob("*.so")):
                log.warning("building the engine's CPU kernels once for this machine into %s (~25 s)", folder)
            cpp_extension.load(name=build_name(), sources=[str(p) for p in SOURCES], extra_cflags=_flags(),
                               extra_include_paths=[str(CSRC)], extra_ldflags=_LDFLAGS, is_python_module=False,
                               verbose=False)
            _loaded["ops"] = torch.ops.areal_flow
        except Exception as e:  # any build/load failure: the caller falls back or names the key
            _loaded["error"] = f"building the CPU kernels ({', '.join(p.name for p in SOURCES)}) failed: " \
                               f"{type(e).__name__}: {e}"
            raise RuntimeError(_loaded["error"]) from e
        return _loaded["ops"]


def main() -> None:
    """``python -m runtime.engines.cpu_kernels``: build now (``make test`` does, so no test pays the
    first build inside a timed worker start); prints the build's name."""
    load()
    print(f"CPU kernels ready: {build_name()}")


if __name__ == "__main__":
    main()
