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
turns it off. A multi-rank trainer takes no part (its ranks are other processes). Several
borrowers (a trainer and a critic on meshes of their own) share what is lent: each takes only
what the others have not taken at their last boundary (a second array), so a lent core goes to
one of them (two reading at the same instant may both take it until their next boundary). The
trainer's thread count then depends on timing, and with it the order of its floating-point
sums: a ``k >= 1`` run was not bit-reproducible before (which policy version generates which
group is timing too); ``k = 0`` runs are untouched. The ledger is two shared-memory arrays of
one integer a worker, the threads it lends now and the lent threads it runs now; a worker
writes only its own slots, so no lock is needed.
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
        self.taken = ctx.Array("i", n, lock=False)
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
        slot = self.slots[worker]
        self.lent[slot] = self.taken[slot] = 0  # a restarted worker's predecessor may have died lending
        return CoreShare(self.lent, self.taken, slot, base, self.cores)


@dataclass
class CoreShare:
    """One worker's slot in a :class:`CoreLedger` (picklable into a spawned process).

    Attributes:
        lent, taken: the ledger's shared arrays (threads each worker lends now; lent threads each
            runs now). slot: this worker's index in them.
        base: its own threads (the launcher's split). cores: the most it may run.
    """

    lent: object
    taken: object
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
        self.lent[self.slot], self.taken[self.slot] = self.base, 0  # it runs nothing while it waits
        started = time.perf_counter()
        try:
            yield
        finally:
            self.lent[self.slot] = 0
            self._lent_s += time.perf_counter() - started

    def threads(self) -> int:
        """The threads this worker may run now: its own plus what the others lend and no other
        borrower has taken, at most :attr:`cores`."""
        others = [i for i in range(len(self.lent)) if i != self.slot]
        spare = sum(self.lent[i] for i in others) - sum(self.taken[i] for i in others)
        return self.base + max(0, min(self.cores - self.base, spare))

    def fit(self) -> int:
        """Take :meth:`threads` (what it runs beyond its own share is marked taken) and set this
        process's torch threads to it (only when it changed); returns it."""
        n = self.threads()
        self.taken[self.slot] = n - self.base
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
                                 "borrowed": self._borrowed, "most_threads": max(self._most, self.base)}}

    def follow(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Call :meth:`fit` at the phase boundaries of ``model``'s training: before each of its
        blocks' forward (the modules of its first, outermost ``nn.ModuleList``: a decoder's layers;
        the whole model when it has none), when the backward reaches each block's output, and before
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
