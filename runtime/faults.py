"""Fault injection at named points of the workers: ``debug.kill_at`` (drills and tests).

Owns the points a worker may be killed at and the rule that each fires once per run. An
entry ``"<worker>:<point>:<version>"`` of ``debug.kill_at`` (``areal_flow.config.DebugConfig``)
makes worker ``<worker>`` (``<group>/<rank>``, e.g. ``generate/0``) SIGKILL its own process
at ``<point>`` for policy ``<version>``, as an out-of-memory kill or a lost machine would,
on either scheduler. Points (``areal_flow.config_run.KILL_POINTS``):

* ``weights_received``: a generation replica has received every bucket of the version and
  has not loaded it into its engine nor reported it (``runtime.workers``);
* ``weights_published``: the trainer has sent the version on its weight channel and has
  not yet recorded the step that made it (trajectories, checkpoint, metrics;
  ``runtime.stage_worker``).

Before it dies the worker writes ``<run>/faults/<group>-<rank>-<point>-<version>`` and says
so on stderr; an entry whose file exists does not fire again, so a restarted worker passes
the point. Before any worker starts, :func:`check_kill_at` refuses an entry that could never
fire (no such worker, a point that worker never passes, a version the run never makes).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from areal_flow.config import ConfigError, parse_kill_at


def check_kill_at(plan, topo) -> None:
    """Check every ``debug.kill_at`` entry of ``plan`` against its workers (``topo``:
    ``runtime.topology.build_topology(plan)``): the group and rank exist, the point is one
    that group's workers pass (``weights_received``: the generation group;
    ``weights_published``: the trainer's group) and the version is one the run publishes
    (``1 .. train.steps``).

    Raises:
        ConfigError: one line naming the entry and what exists.
    """
    workers = {g.name: g for g in topo.groups.values()}
    steps = plan.run["steps"]
    for entry in plan.run.get("debug", {}).get("kill_at", []):
        worker, point, version = parse_kill_at(entry)
        group, rank = worker.split("/")
        found = workers.get(group)
        passes = {"weights_received": [g.name for g in workers.values() if g.kind == "generation"],
                  "weights_published": [g.name for g in workers.values() if g.batch_nodes]}[point]
        if found is None or int(rank) >= found.replicas:
            have = ", ".join(f"{g.name}/0" + (f"..{g.replicas - 1}" if g.replicas > 1 else "")
                             for g in workers.values())
            raise ConfigError(f"debug.kill_at entry {entry!r}: this plan has no worker {worker}; its workers: {have}")
        if group not in passes:
            raise ConfigError(f"debug.kill_at entry {entry!r}: worker {worker} never passes {point}; "
                              f"workers of {', '.join(passes)} do")
        if version > steps:
            raise ConfigError(f"debug.kill_at entry {entry!r}: version {version} is beyond train.steps={steps} "
                              f"(the run publishes versions 1..{steps})")


def kill_point(plan, out_dir: str, worker: str, point: str, version: int) -> None:
    """SIGKILL this process when ``plan``'s ``debug.kill_at`` names ``worker`` at ``point`` for
    ``version`` and the entry has not fired in this run yet (module doc); else return."""
    for entry in plan.run.get("debug", {}).get("kill_at", []):
        if parse_kill_at(entry) != (worker, point, version):
            continue
        marker = Path(out_dir) / "faults" / f"{worker.replace('/', '-')}-{point}-{version}"
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(entry)
        print(f"areal-flow: {worker}: debug.kill_at {entry}: killing this process", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
