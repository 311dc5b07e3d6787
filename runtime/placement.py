"""Devices as placed: which of its machine's devices a local worker process may use.

Owns the mapping from the plan's device meshes to one local worker's devices, and applying
it to the process before any model is built (the local scheduler; Ray does the same through
``num_gpus``). A mesh ``n0:g1-2`` holds devices 1 and 2 of machine 0:

* a generation group of ``dN`` replicas gives replica ``r`` its ``n_devices / N`` consecutive
  devices (``gen:d2`` on ``n0:g0-1``: replica 0 device 0, replica 1 device 1);
* any other group (a trainer and its ranks, a reference model's mesh) gets all of its mesh's
  devices.

On CUDA the worker sees exactly those GPUs (``CUDA_VISIBLE_DEVICES``, composed with the
driver's own, so plan device ``i`` is the driver's ``i``-th visible GPU); its ``cuda`` is the
first of them and a multi-rank trainer's rank ``j`` takes the ``j``-th. On CPU, with
``scheduler.cpu_pinning`` on, the worker is pinned to one core per plan device
(``os.sched_setaffinity``; device ``i`` is the ``i``-th core the driver may use, modulo their
count) and its torch threads match the cores; off (the default), the cores are shared and the
scheduler's thread split applies.
"""

from __future__ import annotations

import os

from compiler.mesh import MeshSpec


def worker_devices(mesh: MeshSpec, replicas: int, rank: int) -> tuple[int, ...]:
    """The device indices (on its machine) of worker ``rank`` of a group of ``replicas`` on ``mesh``.

    Raises:
        ValueError: ``replicas`` does not divide the mesh's devices, or ``rank`` is out of range.
    """
    if replicas < 1 or mesh.n_devices % replicas or not 0 <= rank < replicas:
        raise ValueError(f"mesh {mesh.label()}: {mesh.n_devices} device(s) for {replicas} replica(s), rank {rank}")
    per = mesh.n_devices // replicas
    return tuple(range(mesh.first_device + rank * per, mesh.first_device + (rank + 1) * per))


def visible_gpus(devices: tuple[int, ...], inherited: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a worker on plan devices ``devices``, given the driver's own
    value ``inherited`` (None or empty: every GPU, numbered from 0).

    Raises:
        ValueError: a device beyond the GPUs the driver may see (names both).
    """
    pool = [g.strip() for g in inherited.split(",") if g.strip()] if inherited else None
    if pool is None:
        return ",".join(str(d) for d in devices)
    if max(devices) >= len(pool):
        raise ValueError(f"plan devices {list(devices)}: the driver sees {len(pool)} GPU(s) "
                         f"(CUDA_VISIBLE_DEVICES={inherited})")
    return ",".join(pool[d] for d in devices)


def pinned_cores(devices: tuple[int, ...], allowed: set[int]) -> set[int]:
    """One core per plan device: device ``i`` is the ``i``-th of the ``allowed`` cores (sorted),
    modulo their count (a plan with more CPU devices than cores shares them)."""
    cores = sorted(allowed)
    return {cores[d % len(cores)] for d in devices}


def place_process(devices: tuple[int, ...], device_type: str, cpu_pinning: bool) -> dict:
    """Apply the placement to this process (call before torch touches a device); returns what
    was set, for the run's summary: ``{"devices", "cuda_visible_devices" | "cores"}``."""
    placed: dict = {"devices": list(devices)}
    if not devices:
        return placed
    if device_type == "cuda":
        value = visible_gpus(devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
        os.environ["CUDA_VISIBLE_DEVICES"] = value
        placed["cuda_visible_devices"] = value
    elif cpu_pinning and hasattr(os, "sched_setaffinity"):
        cores = pinned_cores(devices, os.sched_getaffinity(0))
        os.sched_setaffinity(0, cores)
        placed["cores"] = sorted(cores)
    return placed
