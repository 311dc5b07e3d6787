"""The environment a local worker process starts with: how its idle OpenMP threads wait and,
on a CPU plan, how glibc's malloc keeps the memory it frees.

Owns the variables the local launcher (``runtime.launch``) sets for the processes it starts,
each only where the user's environment does not set it already (so exporting one overrides
it), through :func:`started_with`:

* :data:`OMP_PASSIVE`: idle OpenMP threads of a waiting worker sleep after a short spin
  (``OMP_WAIT_POLICY=PASSIVE``, ``GOMP_SPINCOUNT`` = :data:`OMP_SPIN`), so a worker that waits
  leaves the cores to the others; every local worker, the hybrid one too.
* :data:`CPU_MALLOC` (CPU plans): glibc's malloc serves every allocation from its heap and
  never gives freed memory back to the kernel (``MALLOC_MMAP_MAX_=0``,
  ``MALLOC_TRIM_THRESHOLD_`` of 1 TiB; the glibc manual's "Memory Allocation Tunables").
  PyTorch's CPU allocator is glibc's malloc: by default every tensor above the mmap threshold
  (128 KiB, growing to at most 32 MiB) is a fresh ``mmap`` and is unmapped when freed, so each
  training step faults its activations, logits and gradients in again page by page; the
  chat job's SmolLM2 train step took ~300,000 minor faults (1.2 GB of 4 KiB pages) and 0.44 s
  of kernel time of its 4.0 s, 3.55 s and none with these two (``docs/PERFORMANCE.md``, the
  allocator). The cost: a worker's resident memory stays at its high-water mark. (Transparent
  huge pages for torch's allocations, ``THP_MEM_ALLOC_ENABLE=1``, were slower and erratic on
  this VM: 3.8-8.0 s steps.)

``bench/vs_trl.py`` starts TRL's process with :data:`CPU_MALLOC` too, so the peer runs with the
same allocator settings.
"""

from __future__ import annotations

import contextlib
import os

OMP_SPIN = "10000"
"""``GOMP_SPINCOUNT`` of a worker: an idle OpenMP thread spins this many rounds (tens of
microseconds) before it sleeps. With 0 (what ``PASSIVE`` alone gives) every parallel region
wakes its threads from sleep: the tiny main job's 2-thread train step took 191 ms against 59-63 ms
with this spin (``bench/train_throughput.py``-style step, quiet box, docs/PERFORMANCE.md), while
a waiting worker's threads still leave the cores to the other within the spin."""

OMP_PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": OMP_SPIN}
"""Idle OpenMP threads sleep after a short spin."""

CPU_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
"""glibc malloc: no allocation by ``mmap``, no trimming of the heap (module doc)."""


@contextlib.contextmanager
def started_with(defaults: dict[str, str]):
    """``os.environ`` with each of ``defaults`` set unless it is set already, for the processes
    started inside the ``with`` body (a spawned process copies the environment when it starts);
    restored after."""
    previous = {k: os.environ.get(k) for k in defaults}
    for key, value in defaults.items():
        os.environ[key] = value if previous[key] is None else previous[key]  # set, even empty: the user's
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                del os.environ[key]
