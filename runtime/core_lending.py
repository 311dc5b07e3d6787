"""Idle cores lent between the local scheduler's worker processes on a CPU machine.

Owns :class:`CoreLedger` (made by the local launcher, shared by its workers) and
:class:`CoreShare` (one worker's slot in it). With ``async.max_staleness >= 1`` the local
scheduler splits the cores among the worker processes (``runtime.launch``: ``cores //
processes`` torch threads each), but a worker is not always computing: on the SmolLM2 chat
job the generation replica decodes a step's groups in ~1.1 s and then waits ~3.4 s for the
next weights while the trainer computes alone on one core (``areal-flow timeline``: generate
busy 24.6 %, train_step 95.3 %). A waiting worker lends its threads (:meth:`CoreShare.lending`:
a generation replica with nothing to decode, a stage worker waiting for its input); a
one-process trainer (a train_step or critic_step) takes, at each of its phase boundaries
(:meth:`CoreShare.fit`, hooked by :meth:`CoreShare.follow`: every decoder layer's forward and
backward, the optimizer step), its own share plus what the others lend now, at most the
machine's cores (``torch.set_num_threads``). A lender that wakes takes its share back at once
and the trainer returns it at its next boundary (a layer: tens of milliseconds on that job),
so the two overlap on one core only that long. Generation replicas lend but do not borrow:
the main job's 1 M-parameter engine stepped 8 % slower so (22.8 against 21.0 ms, loop not
faster; docs/PERFORMANCE.md).

Only where the cores are split among workers that share them: the local scheduler on CPU with
``scheduler.threads_per_worker=0`` and ``scheduler.cpu_pinning=false``, ``k >= 1`` (with
``k = 0`` each worker already has every core), not the hybrid worker; ``scheduler.lend_idle_cores``
turns it off. A multi-rank trainer takes no part (its ranks are other processes). The
trainer's thread count then depends on timing, and with it the order of its floating-point
sums: a ``k >= 1`` run was not bit-reproducible before (which policy version generates which
group is timing too); ``k = 0`` runs are untouched. The ledger is a shared-memory array of
one integer a worker, the threads it lends now; a worker writes only its own slot, so no
lock is needed.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from dataclasses import dataclass

import torch


class CoreLedger:
    """The threads each of ``n`` worker processes lends now (shared memory; ``mp.Array``).

    Args:
        n: worker processes taking part (slots ``0..n-1``).
        cores: the machine's cores, the most threads one worker may run.
        ctx: the multiprocessing context the workers are started with.
    """

    def __init__(self, n: int, cores: int, ctx=mp) -> None:
        self.lent = ctx.Array("i", n, lock=False)
        self.cores = cores
        self.slots: dict[str, int] = {}

    def share(self, worker: str, base: int) -> CoreShare:
        """The slot of worker ``worker`` (the same slot when a restarted worker asks again),
        whose own share is ``base`` threads.

        Raises:
            ValueError: more workers than the ledger has slots.
        """
        if worker not in self.slots:
            if len(self.slots) == len(self.lent):
                raise ValueError(f"core ledger: {len(self.lent)} slots taken, no slot for worker {worker!r}")
            self.slots[worker] = len(self.slots)
        self.lent[self.slots[worker]] = 0  # a restarted worker's predecessor may have died lending
        return CoreShare(self.lent, self.slots[worker], base, self.cores)


@dataclass
class CoreShare:
    """One worker's slot in a :class:`CoreLedger` (picklable into a spawned process).

    Attributes:
        lent: the ledger's shared array. slot: this worker's index in it.
        base: its own threads (the launcher's split). cores: the most it may run.
    """

    lent: object
    slot: int
    base: int
    cores: int
    _threads: int = 0  # what this process last set (0: not yet)
    _fits: int = 0
    _borrowed: int = 0
    _most: int = 0
    _lent_s: float = 0.0

    @contextlib.contextmanager
    def lending(self):
        """Lend this worker's threads to the others for the ``with`` body (it waits there)."""
        self.lent[self.slot] = self.base
        started = time.perf_counter()
        try:
            yield
        finally:
            self.lent[self.slot] = 0
            self._lent_s += time.perf_counter() - started

    def threads(self) -> int:
        """The threads this worker may run now: its own plus what the others lend, at most
        :attr:`cores`."""
        others = sum(self.lent[i] for i in range(len(self.lent)) if i != self.slot)
        return min(self.cores, self.base + others)

    def fit(self) -> int:
        """Set this process's torch threads to :meth:`threads` (only when it changed); returns it."""
        n = self.threads()
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n
        self._fits, self._borrowed, self._most = self._fits + 1, self._borrowed + (n > self.base), max(self._most, n)
        return n

    def report(self) -> dict:
        """For the worker's summary (``summary.json``, ``workers.<name>.core_lending``): its own
        threads, the seconds it lent them, the phases it fitted, how many of them ran on lent
        threads, the most it ran."""
        return {"core_lending": {"own_threads": self.base, "lent_s": round(self._lent_s, 3), "phases": self._fits,
                                 "borrowed": self._borrowed, "most_threads": self._most}}

    def follow(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Call :meth:`fit` at the phase boundaries of ``model``'s training: before each of its
        blocks' forward (the modules of its ``nn.ModuleList`` s: a decoder's layers; the whole
        model when it has none), when the backward reaches each block's output, and before
        ``optimizer.step()``. The hooks stay for the model's life."""
        layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), None)
        for block in layers if layers else [model]:  # the outermost list: a decoder's layers
            block.register_forward_pre_hook(self._before_forward)
            block.register_forward_hook(self._after_forward)
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._before_step)

    def _before_forward(self, module, args) -> None:
        self.fit()

    def _after_forward(self, module, args, out) -> None:
        tensor = out if isinstance(out, torch.Tensor) else next(
            (t for t in (out if isinstance(out, (tuple, list)) else ()) if isinstance(t, torch.Tensor)), None)
        if tensor is not None and tensor.requires_grad:  # fires when the backward reaches this block
            tensor.register_hook(self._before_backward)

    def _before_backward(self, grad: torch.Tensor) -> None:
        self.fit()

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.fit()
