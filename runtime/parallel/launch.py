"""Start one worker process per device of a node and run a function in each.

The launcher owns process start-up only: the ``torch.distributed`` rendezvous (a free
loopback port, or a :class:`RankSpan`'s address when the ranks of one group are spread
over several machines, one launcher each), the backend choice (NCCL when CUDA is
available, gloo on CPU), one thread per CPU worker, and collecting each rank's
return value. What the workers do (build a mesh, parallelize a model) belongs to
the other modules of ``runtime.parallel``.

:func:`launch_strategy` validates a :class:`ParallelStrategy` against the model
config *before* any process starts, so a bad strategy costs no process start.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from compiler.strategy import ParallelStrategy
from runtime.channel_auth import check_secret, new_secret
from runtime.lifecycle import die_with_parent
from runtime.owned_dir import RANKS, new_owned_dir, remove_owned_dir
from runtime.parallel.signed_objects import set_secret
from runtime.parallel.validate import validate_strategy_for_model

WorkerFn = Callable[..., Any]


class WorkerError(RuntimeError):
    """A worker process raised; the message holds the rank and its traceback."""


class RankKilled(WorkerError):
    """A worker process ended by a signal without raising (killed, out of memory):
    ``rank`` and ``signal`` (its number, e.g. 9 for SIGKILL)."""

    def __init__(self, rank: int, signal: int) -> None:
        super().__init__(f"rank {rank} was ended by signal {signal} (exit code {-signal})")
        self.rank, self.signal = rank, signal

    def __reduce__(self):  # pickled whole (Ray carries it to the driver): the default passes only the message
        return RankKilled, (self.rank, self.signal)


@dataclass(frozen=True)
class RankSpan:
    """The ranks one launcher starts of a ``torch.distributed`` group that may span machines.

    Attributes:
        first: the global rank of its first process. count: how many it starts (ranks
            ``first .. first + count - 1``; local rank ``i`` is global rank ``first + i``).
        master: ``MASTER_ADDR``, the IP of the machine running global rank 0 (its
            ``TCPStore``), reachable from every machine of the group.
        port: ``MASTER_PORT`` on it (a port free there when chosen).
    """

    first: int
    count: int
    master: str
    port: int


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend() -> str:
    """``"nccl"`` when CUDA devices are visible, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _worker_entry(
    local: int, fn: WorkerFn, world_size: int, span: RankSpan, backend: str, timeout_s: float, args: tuple,
    out_dir: str, secret: bytes,
) -> None:
    # A rank does not outlive the process that spawned it, even one that died while this rank was
    # still importing (before the kernel's parent-death signal was asked for): it would wait in
    # the rendezvous below until its timeout (found by bench/chaos.py: a driver killed at start-up).
    die_with_parent(multiprocessing.parent_process().pid)
    set_secret(secret)
    rank = span.first + local
    os.environ.update(MASTER_ADDR=span.master, MASTER_PORT=str(span.port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(local))
    if backend == "nccl":  # the machine's devices this launcher may use, in local-rank order
        torch.cuda.set_device(local % torch.cuda.device_count())
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:  # the parent re-raises it with the rank attached
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as handle:
            handle.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def spawn_workers(
    fn: WorkerFn, world_size: int, args: tuple = (), *, backend: str | None = None, timeout_s: float = 120.0,
    secret: bytes | None = None, span: RankSpan | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes (or in the
    ranks of ``span``, this machine's share of a group spread over machines).

    Each process has ``torch.distributed`` initialised (``init_process_group``
    over a free 127.0.0.1 port, or ``span``'s address) before ``fn`` runs and destroyed after it.
    Return values travel back through files in a temporary folder (a pipe
    would block on payloads over its 64 KiB buffer), removed after the ranks end, or by the
    next launcher on this machine if this process was SIGKILLed (``runtime.owned_dir``).

    Args:
        fn: a module-level (picklable) function; its return value must be
            ``torch.save``-able (tensors, dicts, numbers).
        world_size: number of processes (one per device of the node).
        args: extra positional arguments, pickled to each process.
        backend: ``"gloo"`` or ``"nccl"``; default :func:`default_backend`.
        timeout_s: collective timeout in seconds (a stuck rank fails instead of hanging).
        secret: the key of the ranks' signed objects (``runtime.parallel.signed_objects``;
            the run's channel secret); None: a fresh one (``runtime.channel_auth.new_secret``).
            It reaches the ranks through their start (a process pipe), never the store.
        span: the ranks to start here and the rendezvous address (:class:`RankSpan`; the
            launchers of the other ranks run on other machines with the same ``world_size``,
            address and secret); None: every rank, here, on loopback.

    Returns:
        ``fn``'s return values of the ranks started here, ordered by rank.

    Raises:
        ValueError: ``world_size < 1``, ``secret`` shorter than 16 bytes, or ``span``'s ranks
            outside ``0 .. world_size - 1``.
        WorkerError: a worker raised; the message holds its rank and traceback.
        RankKilled: a worker was ended by a signal (none raised).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: need at least one worker")
    span = span or RankSpan(0, world_size, "127.0.0.1", free_loopback_port())
    if span.first < 0 or span.count < 1 or span.first + span.count > world_size:
        raise ValueError(f"ranks {span.first}..{span.first + span.count - 1}: outside a group of {world_size}")
    backend = backend or default_backend()
    secret = new_secret() if secret is None else check_secret(secret, "spawn_workers")
    out_dir = new_owned_dir(RANKS)  # swept by a later launcher if this process is SIGKILLed
    try:
        mp.start_processes(
            _worker_entry,
            args=(fn, world_size, span, backend, timeout_s, args, out_dir, secret),
            nprocs=span.count,
            join=True,
            start_method="spawn",
        )
        return [torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False)
                for rank in range(span.first, span.first + span.count)]
    except ProcessException as exc:
        if isinstance(exc, ProcessExitedException) and exc.exit_code < 0:  # the first to end was killed
            raise RankKilled(span.first + exc.error_index, -exc.exit_code) from exc  # (the others' follow)
        errors = sorted(name for name in os.listdir(out_dir) if name.endswith(".err"))
        details = [f"{name[:-4]}:\n" + open(os.path.join(out_dir, name)).read() for name in errors]
        raise WorkerError("\n".join(details) or str(exc)) from exc
    finally:
        remove_owned_dir(out_dir)


def launch_strategy(
    fn: WorkerFn, strategy: ParallelStrategy, model_config: Any, args: tuple = (), *, backend: str | None = None
) -> list[Any]:
    """Validate ``strategy`` for ``model_config``, then spawn ``strategy.world_size`` workers.

    ``fn`` is called as ``fn(rank, world_size, *args)``.

    Raises:
        compiler.strategy.StrategyError: the strategy breaks a rule of the model
            (raised in this process, before any worker starts).
        WorkerError: as :func:`spawn_workers`.
    """
    validate_strategy_for_model(strategy, model_config)
    return spawn_workers(fn, strategy.world_size, args, backend=backend)
