"""A multi-rank trainer whose ranks are spread over machines on Ray: its rank hosts.

On Ray each worker is one actor, and a worker's processes run on its actor's machine. The
policy's multi-rank train_step may span several machines (``compiler.hosting``, rule
``ray-one-machine``): its stage worker's actor (``<group>/0``, on the mesh's first machine)
spawns that machine's ranks, rank 0 among them, and one *rank host* actor on each other
machine of the mesh (``<group>/0@n<j>``, ``j`` = the machine's place in the mesh) spawns
that machine's ranks (``runtime.trainer_ranks.run_rank_host``); all of them join one
``torch.distributed`` group at rank 0's machine (``runtime.parallel.launch.RankSpan``).
Machine ``j`` of the mesh holds global ranks ``j * r .. (j + 1) * r - 1`` (``r`` = ranks per
machine), so the innermost degrees of the strategy (``tp``, then ``cp``...) stay inside a
machine when they divide ``r``, as Megatron and torchtitan lay out their meshes.

Owns only the bookkeeping the Ray scheduler needs: the hosts' names, their specs, and how
their ends reach the driver, which knows only the stage worker ``<group>/0``: a host that
ends normally is forgotten; a host whose actor died (a rank killed: the host ends by its
signal) is reported as the stage worker's death, so the driver restarts every worker from
the last checkpoint (as for any dead trainer); a host that raised is remembered and its
error appended to the stage worker's (rank 0 fails in a collective with it; the host's
error is the cause). Checkpoints: every rank writes its shards under the run folder, so
``out_dir`` must be storage every machine of the mesh shares (docs/RAY.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import ray
from ray.exceptions import RayActorError, RayTaskError

from runtime.driver import DIED, ERROR, WorkerEnd
from runtime.parallel.launch import RankKilled, RankSpan
from runtime.topology import WorkerGroup
from runtime.workers import WorkerSpec

HOST_GRACE_S = 10.0
"""Seconds the stage worker's error waits for its rank hosts' ends (a host killed by a rank's
signal is the cause when rank 0 failed in a collective with it)."""


def spans_machines(group: WorkerGroup) -> bool:
    """Whether ``group`` is a multi-rank trainer whose mesh spans machines (it has rank hosts)."""
    return group.ranks > 1 and group.mesh.n_nodes > 1


def actor_names(group: WorkerGroup) -> list[str]:
    """Its actors' names, one per machine of its mesh in mesh order for a trainer spread over
    machines (:func:`spans_machines`), else ``<group>/<replica>``."""
    if spans_machines(group):
        return [f"{group.name}/0"] + [f"{group.name}/0@n{j}" for j in range(1, group.mesh.n_nodes)]
    return [f"{group.name}/{r}" for r in range(group.replicas)]


def rank_specs(spec: WorkerSpec, group: WorkerGroup, master: str, port: int) -> dict[str, WorkerSpec]:
    """Each actor's spec (stage worker first) with its machine's ranks and the rendezvous at
    ``master:port`` (rank 0's machine)."""
    per = group.ranks // group.mesh.n_nodes
    return {name: replace(spec, ranks=RankSpan(j * per, per, master, port))
            for j, name in enumerate(actor_names(group))}


class RankHosts:
    """The rank hosts started in one attempt and what their ends mean to the driver;
    ``cause(exc)``: why an actor died, in a few words (``runtime.ray_scheduler``)."""

    def __init__(self, cause: Callable[[RayActorError], str]) -> None:
        self.cause = cause
        self.running: dict = {}  # object ref of a host's run -> (host name, its stage worker's name)
        self.errors: dict[str, list[str]] = {}  # stage worker -> its hosts' errors

    def started(self, ref, host: str, lead: str) -> None:
        self.running[ref] = (host, lead)

    def refs(self) -> list:
        return list(self.running)

    def end(self, ref) -> WorkerEnd | None:
        """What host ``ref``'s end means: the stage worker's death (its actor died, or a rank
        was ended by a signal: ``RankKilled``, which ``runtime.trainer_ranks`` turns into the
        host's death by that signal, a race Ray may lose), else None (ended normally, or
        raised: remembered for :meth:`lead_error`)."""
        host, lead = self.running.pop(ref)
        try:
            ray.get(ref)
        except RayTaskError as exc:
            if isinstance(exc.cause, RankKilled):  # raised while the host's own signal was still on its way
                return WorkerEnd(lead, DIED, f"its ranks on {host} died: {exc.cause}")
            self.errors.setdefault(lead, []).append(f"{host}:\n{exc}")
        except RayActorError as exc:
            return WorkerEnd(lead, DIED, f"its ranks on {host} died: {self.cause(exc)}")
        return None

    def lead_error(self, lead: str, error: str) -> WorkerEnd:
        """The end to report for stage worker ``lead`` that raised ``error``: waits up to
        :data:`HOST_GRACE_S` for its hosts; a dead one makes it a death (restart), else the
        error with its hosts' errors appended."""
        mine = [ref for ref, (_, owner) in self.running.items() if owner == lead]
        ready, _ = ray.wait(mine, num_returns=len(mine), timeout=HOST_GRACE_S) if mine else ([], [])
        died = [end for end in map(self.end, ready) if end is not None]
        if died:
            return died[0]
        return WorkerEnd(lead, ERROR, "\n".join([error, *self.errors.get(lead, [])]))

    def clear(self) -> None:
        self.running, self.errors = {}, {}
