"""The processes of one run that ``bench/chaos.py`` kills: found under its driver with psutil,
named by kind, remembered for the leak check, their memory summed.

Owns finding and naming processes only (never the run's files). How a kind is told apart:
a local worker is a ``multiprocessing`` spawn child of the driver whose bound ``ipc://``
socket is named ``<group>-<rank>`` (``runtime/launch.py``): ``generate-*`` a generation
replica, ``train_step-*`` the trainer, any other group a stage worker; a spawn child of a
worker is a trainer rank (``runtime/parallel/launch.py``). On Ray, an actor's worker process
has the title ``ray::WorkerActor...`` (the trainer's metrics queue ``ray::_QueueActor``),
and the run's own cluster's ``raylet`` and ``gcs_server`` are children of the driver.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import psutil

GENERATION, TRAINER, STAGE, RANK = "generation replica", "trainer", "stage worker", "trainer rank"
DRIVER, ACTOR, QUEUE, RAYLET, GCS = "driver", "ray worker actor", "ray metrics queue", "ray node (raylet)", "ray gcs"


def _kind(proc: psutil.Process, driver: int) -> str:
    """The victim kind of a descendant of the driver; "" for one not to kill (a resource
    tracker, an idle Ray worker, Ray's log and dashboard processes, one still starting)."""
    cmd = " ".join(proc.cmdline())
    if cmd.startswith("ray::WorkerActor"):
        return ACTOR
    if cmd.startswith("ray::_QueueActor"):
        return QUEUE
    if "/raylet" in cmd.split(" ")[0]:
        return RAYLET
    if "gcs_server" in cmd.split(" ")[0]:
        return GCS
    if "spawn_main" not in cmd:
        return ""
    if proc.ppid() != driver:
        return RANK if "spawn_main" in " ".join(psutil.Process(proc.ppid()).cmdline()) else ""
    names = {os.path.basename(c.laddr) for c in proc.net_connections(kind="unix") if c.laddr}
    group = next((n.rsplit("-", 1)[0] for n in names if n.rsplit("-", 1)[-1].isdigit()
                  and not n.startswith("weights")), "")
    return {"generate": GENERATION, "train_step": TRAINER, "": ""}.get(group, STAGE)


class RunProcesses:
    """Every process seen under a run's drivers (all attempts), for the kills and the leak check."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[float, str]] = {}  # pid -> (create time, command line)
        self.ever: set[int] = set()

    def _tree(self, driver: int) -> list[psutil.Process]:
        try:
            root = psutil.Process(driver)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def scan(self, driver: int) -> None:
        """Remember the driver and every process under it now."""
        for p in self._tree(driver):
            if p.pid not in self.seen:
                try:
                    self.seen[p.pid] = (p.create_time(), " ".join(p.cmdline())[:160])
                    self.ever.add(p.pid)
                except psutil.Error:
                    continue

    def victims(self, driver: int) -> dict[str, list[psutil.Process]]:
        """Live processes of the run by kind (the driver included)."""
        found: dict[str, list[psutil.Process]] = defaultdict(list)
        tree = self._tree(driver)
        if tree:
            found[DRIVER].append(tree[0])
        for p in tree[1:]:
            try:
                kind = _kind(p, driver)
            except psutil.Error:
                continue
            if kind:
                found[kind].append(p)
        return dict(found)

    def rss(self, driver: int) -> tuple[int, int]:
        """(the driver's RSS, the sum of its descendants' RSS), bytes."""
        tree, sizes = self._tree(driver), []
        for p in tree:
            try:
                sizes.append(p.memory_info().rss)
            except psutil.Error:
                sizes.append(0)
        return (sizes[0], sum(sizes[1:])) if sizes else (0, 0)

    def alive(self, timeout: float) -> list[psutil.Process]:
        """The seen processes still running after up to ``timeout`` seconds (the rest forgotten)."""
        deadline = time.monotonic() + timeout
        while True:
            left = []
            for pid, (created, _) in list(self.seen.items()):
                try:
                    p = psutil.Process(pid)
                    if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                        left.append(p)
                        continue
                except psutil.Error:
                    pass
                del self.seen[pid]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    def describe(self, proc: psutil.Process) -> str:
        return f"pid {proc.pid} ({self.seen.get(proc.pid, (0, '?'))[1]})"

    def listening_ports(self) -> list[str]:
        """Listening TCP ports held by any process this run ever had."""
        try:
            conns = psutil.net_connections(kind="inet")
        except psutil.Error:
            return []
        return [f"{c.laddr.ip}:{c.laddr.port} (pid {c.pid})" for c in conns
                if c.status == psutil.CONN_LISTEN and c.pid in self.ever]


def kill_and_reap(procs: list[psutil.Process]) -> None:
    """SIGKILL each of ``procs`` and wait up to 10 s for them."""
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)
