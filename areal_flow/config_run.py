"""Typed configuration of how a run operates: the ``scheduler``, ``eval``, ``logging`` and
``debug`` sections of the experiment config (``areal_flow.config.ExperimentConfig`` embeds them).

Owns these dataclasses, their keys' defaults and one-line docs, and the checks of a single
key's value (``__post_init__``, :func:`parse_kill_at`); checks across sections stay in
``ExperimentConfig.__post_init__``. It must not act on the config.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from areal_flow.config_keys import ConfigError


@dataclass
class SchedulerConfig:
    type: str = "local"
    """local (OS processes on this machine) or ray."""
    address: str = ""
    """Ray cluster address; empty = RAY_ADDRESS or a new local cluster."""
    node_ip: str = ""
    """This machine's IP as the Ray cluster sees it (like ray start --node-ip-address); empty = Ray's choice."""
    bind_host: str = ""
    """Where Ray workers' channels bind: empty = loopback 127.0.0.1 (one machine), 'node' = each worker's node IP as Ray knows it (a multi-node cluster), or an interface's IP."""
    device_resource: str = ""
    """Ray resource one plan device stands for (e.g. a custom 'gpu_slot'); empty = GPU, or CPU when cluster.gpu=cpu."""
    max_restarts: int = 3
    """Restarts of dead workers in a run, on either scheduler: a generation replica or actor (its groups are regenerated), or a trainer (every worker restarts from the last checkpoint); 0 = a death fails the run."""
    placement_timeout_s: float = 60.0
    """Seconds to wait for the placement groups (free resources) before failing."""
    cpu_pinning: bool = False
    """Local scheduler on CPU: pin each worker process to one core per plan device of its mesh (device i = the i-th core this process may use, modulo their count) with torch threads to match; false = the cores are shared (threads_per_worker). On CUDA each local worker always sees exactly its mesh's GPUs (CUDA_VISIBLE_DEVICES); runtime.placement."""
    hybrid: bool = False
    """Local scheduler, opt-in: when the allocation time-shares the generation mesh with the trainer ('gen:d1 | train:d1') and both are one process (one generation replica, a one-rank trainer, nothing else on the mesh), run them in ONE process (the embedded engine; vLLM stays apart): two threads, a thread lock as the lease, the weights handed over in memory (runtime.hybrid); false = two processes taking turns through a process lock, the weights over the ipc weight channel. Off by default: bit for bit the same run, but not faster on the shared 2-core box (docs/PERFORMANCE.md, the hybrid worker). Ray always runs two actors. When the plan cannot run in one process the run says why in one line and runs two."""
    threads_per_worker: int = 0
    """torch intra-op threads of each worker process; on Ray 0 = 1 (one per actor CPU), on the local scheduler 0 = automatic: with async.max_staleness=0 the phases alternate and each worker gets every core, with k >= 1 they overlap and the cores are split among the processes (cores // processes, at least 1). bench/async_vs_sync.py sets 1 for its one-thread synchronous run (the ideal's phase times on one core each)."""
    lend_idle_cores: bool = True
    """Local scheduler on CPU, threads_per_worker=0, cpu_pinning off, k >= 1: a worker that waits (a generation replica between batches, a stage worker for its input) lends its threads, and a computing one-process trainer runs its own plus the lent ones, set at each decoder layer's forward and backward and at the optimizer step (runtime.core_lending; generation replicas do not borrow); false = each keeps its split."""


@dataclass
class EvalConfig:
    n_test: int = 500
    """Held-out problems for greedy accuracy before and after RL; at most 500 for the tasks that draw train and test
    from one generator (arithmetic, support_desk, tool_multiply: training keeps only those out, tasks.held_out.HELD_OUT)."""
    every: int = 0
    """Also measure held-out greedy accuracy every this many steps during RL (TensorBoard eval/accuracy); 0 = only before and after."""
    enabled: bool = True
    """Evaluate before and after training."""
    temperature: float = 0.0
    """Sampling temperature of held-out episodes (graphs with ops.rollout); 0 = greedy."""


@dataclass
class LoggingConfig:
    """Where run metrics go besides TensorBoard (runtime.metrics.RunLogger)."""

    wandb: bool = False
    """Also log to Weights & Biases (pip install 'areal-flow[wandb]')."""
    wandb_mode: str = "offline"
    """online, offline (files under <run>/wandb, no network; `wandb sync` later) or disabled."""
    wandb_project: str = "areal-flow"
    """W&B project name."""
    trace: bool = True
    """Write the run's timeline: spans per worker under <run>/trace/, merged into <run>/trace.json (Chrome/Perfetto
    trace; `areal-flow timeline <run>` summarises it)."""

    def __post_init__(self) -> None:
        if self.wandb_mode not in ("online", "offline", "disabled"):
            raise ConfigError(f"logging.wandb_mode={self.wandb_mode!r}: expected online, offline or disabled")
        if self.wandb and importlib.util.find_spec("wandb") is None:
            raise ConfigError("logging.wandb=true needs the wandb package: pip install 'areal-flow[wandb]'")


KILL_POINTS = ("weights_received", "weights_published")
"""The points ``debug.kill_at`` names (``runtime.faults``)."""


def parse_kill_at(entry: str) -> tuple[str, str, int]:
    """``(worker, point, version)`` of one ``debug.kill_at`` entry ``<group>/<rank>:<point>:<version>``.

    Raises:
        ConfigError: another shape, a point not in :data:`KILL_POINTS`, a version below 1
            (quotes the entry).
    """
    parts = entry.split(":") if isinstance(entry, str) else []
    worker, point, version = parts if len(parts) == 3 else ("", "", "")
    group, _, rank = worker.rpartition("/")
    if not (group and rank.isdigit() and point in KILL_POINTS and version.isdigit() and int(version) >= 1):
        raise ConfigError(f"debug.kill_at entry {entry!r}: expected '<group>/<rank>:<point>:<version>' with a point "
                          f"of {', '.join(KILL_POINTS)} and a version >= 1, e.g. 'generate/0:weights_received:2'")
    return worker, point, int(version)


@dataclass
class DebugConfig:
    """Debugging aids (off by default; each costs time or memory)."""

    memory_profiler: bool = False
    """Write a memory profile of the trainer per step to <run>/memory.jsonl: process RSS and the bytes of its
    tensors (parameters, gradients, optimizer state); on CUDA also torch's allocator figures."""
    record: list[str] = field(default_factory=list)
    """Edges 'src->dst' into a batch node of the trainer (e.g. advantage->train_step) whose every item is stored
    under <run>/record/<src>-<dst>/ with a digest of the weights after each step; `areal-flow replay <run> --from
    src->dst` re-runs the downstream nodes on it and checks the weights bit for bit."""
    kill_at: list[str] = field(default_factory=list)
    """Fault injection (drills, tests): entries '<group>/<rank>:<point>:<version>' make that worker SIGKILL its own
    process once per run at the point for that policy version; points: weights_received (a generation replica has the
    version, not yet loaded), weights_published (the trainer sent it, has not recorded its step); runtime/faults.py.
    An entry naming a worker the plan lacks, a point that worker never passes or a version beyond train.steps is
    refused before any worker starts."""

