"""The router: admission at the graph's source and balancing across generation replicas.

Owns the ``dataset`` node's execution and the admission rule of ``runtime.staleness``
for the whole run, whatever the number of replicas. It runs on the driver (a thread), so
one place decides which prompt group gets which admission index, and which replica
generates it (the one with the fewest groups in flight).

Staleness with several replicas. Each replica reports the policy version it has loaded.
The router admits with ``v = min`` over the replicas' versions: a group admitted at
``v_a`` goes to some replica whose version is ``>= v_a`` and never decreases, so every
token of the group comes from a version ``>= v_a``, and ``runtime.staleness``'s proof
holds unchanged (its ``v_a`` is the minimum). Liveness: the trainer publishes version
``s`` to every replica, after which the minimum is ``s`` and capacity ``(k + s + 1) * B``.

A group a filter drops (``dropped`` from a replica, ``resample`` from a later worker group)
gets a new prompt under the same index (DAPO dynamic sampling): attempt ``a`` of index ``i``
gets ``spares(i, a)``, a function of the slot alone (``runtime.spares``), so neither the order
of the drops nor a restart changes which prompt a slot trains. Messages (tuples,
``runtime.channels.MessageSender``): from workers ``("ready"|"version", replica, v)``,
``("sent"|"dropped", replica, index, attempt)``, ``("resample", index, attempt)``, from the
trainer ``("received", index, attempt)`` (a group is re-sent after a replica's death until the
trainer confirms it); to a replica ``("groups", [(index, attempt, problem), ...])`` or ``("stop",)``.

Determinism. The groups admitted in one pass of the loop go to each replica as one
message, so a replica submits them to its engine together, before its next engine step.
With ``k = 0`` a pass admits the whole batch of a version (after every replica has loaded
it), so what each engine batches together — and hence the samples its seeded generator
draws — does not depend on message timing: a ``k = 0`` run is bit-reproducible on one
machine (the same threads), and ``compile.mode=sync`` runs the same plan. With ``k = 0``
resampled slots keep this: their new prompts are dispatched in rounds, as DAPO's reference
generates a further batch, all of a round's replacements in one message (index order) once
no group of the round before is pending (every one dispatched is at the trainer or dropped),
so each round starts on idle engines. With ``k >= 1`` a replacement goes out at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from runtime.channels import MessageReceiver, MessageSender
from runtime.staleness import AdmissionController
from runtime.trace import TraceRecorder, now_us


class Router:
    """Admit ``n_groups`` prompt groups and route them to the replicas.

    Args:
        problems: the dataset's prompts, one per admission index (``[n_groups]``).
        spares: ``spares(index, attempt)``, the prompt of a resampled slot (``runtime.spares``).
        max_staleness / batch_groups: k and B of the edge into the policy's train_step.
        replicas: each replica's prompt address.
        control_address: where workers send their messages (bound here).
        trace / admission_edge: spans of the time the staleness rule blocks admission (every
            replica up, prompts left), named by the edge from the source to the generator.
        secret: the run's channel secret (``runtime.channel_auth``).
        first_index: the first admission index to admit (a resumed run's ``next_index``,
            ``runtime.checkpoint``): every index below it was trained already.

    Attributes:
        dispatched: groups sent to replicas (resamples and re-dispatches included).
        resampled: slots given a new prompt. redispatched: groups sent again after a
        replica was replaced. rejected: control messages dropped unread (MAC failed).
    """

    def __init__(self, problems: list[dict], spares: Callable[[int, int], dict], max_staleness: int, batch_groups: int,
                 replicas: list[str], control_address: str, trace: TraceRecorder | None = None,
                 admission_edge: str = "dataset->generate", *, secret: bytes, first_index: int = 0) -> None:
        self.problems, self.spares, self.secret = problems, spares, secret
        self.admission = AdmissionController(max_staleness, batch_groups)
        self.admission.accepted = first_index  # as if completed: they were trained before the checkpoint
        self.control = MessageReceiver(control_address, secret=secret)
        self.outs = [MessageSender(a, secret=secret) for a in replicas]
        self.versions: dict[int, int] = {}
        self.in_flight: list[dict[tuple[int, int], dict]] = [{} for _ in replicas]  # at the replica (balancing)
        self.unconfirmed: list[dict[tuple[int, int], dict]] = [{} for _ in replicas]  # not yet at the trainer
        self.dispatched = self.resampled = self.redispatched = 0
        self._outbox: list[list[tuple]] = [[] for _ in replicas]
        self._lock = threading.Lock()
        self.trace, self.admission_edge = trace or TraceRecorder(None, "driver"), admission_edge
        self._blocked_since: int | None = None  # microseconds (runtime.trace.now_us)
        self._next_round: list[tuple[int, int]] | None = [] if max_staleness == 0 else None  # k = 0: (index, attempt)

    @property
    def rejected(self) -> int:
        return self.control.rejected

    @property
    def min_version(self) -> int | None:
        if len(self.versions) < len(self.outs):
            return None  # not every replica is up yet
        return min(self.versions.values())

    def _dispatch(self, index: int, attempt: int, problem: dict) -> None:
        """Assign a group to the least loaded replica; :meth:`_flush` sends it."""
        replica = min(range(len(self.outs)), key=lambda r: (len(self.in_flight[r]), r))
        self.in_flight[replica][(index, attempt)] = problem
        self.unconfirmed[replica][(index, attempt)] = problem
        self._outbox[replica].append((index, attempt, problem))
        self.dispatched += 1

    def _flush(self) -> None:
        """Send each replica the groups assigned to it since the last flush, as one message."""
        for replica, groups in enumerate(self._outbox):
            if groups:
                self.outs[replica].send(("groups", groups))
        self._outbox = [[] for _ in self.outs]

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind in ("ready", "version"):
            self.versions[msg[1]] = max(msg[2], self.versions.get(msg[1], -1))
        elif kind in ("sent", "dropped"):
            _, replica, index, attempt = msg
            self.in_flight[replica].pop((index, attempt), None)
            if kind == "dropped":
                self.unconfirmed[replica].pop((index, attempt), None)
                self._resample(index, attempt)
            elif self.admission.is_running(index):  # else a copy re-sent after a replica's restart: completed already
                self.admission.complete(index)
        elif kind == "received":  # the trainer holds the group: no replica needs to keep it
            for held in self.unconfirmed:
                held.pop((msg[1], msg[2]), None)
        elif kind == "resample":
            for held in self.unconfirmed:
                held.pop((msg[1], msg[2]), None)
            self._resample(msg[1], msg[2])

    def _resample(self, index: int, attempt: int) -> None:
        self.resampled += 1
        if self._next_round is None:
            self._dispatch(index, attempt + 1, self.spares(index, attempt + 1))
        else:
            self._next_round.append((index, attempt + 1))

    def _start_round(self) -> None:
        """``k = 0``: dispatch the replacements waiting for their round (module doc) once no
        dispatched group is pending anywhere."""
        if self._next_round and not any(self.unconfirmed):
            for index, attempt in sorted(self._next_round):
                self._dispatch(index, attempt, self.spares(index, attempt))
            self._next_round = []

    def replace_replica(self, replica: int, address: str) -> None:
        """A replica was restarted at ``address``: send it again every group it was given that
        the trainer has not confirmed (a group it sent just before dying may be lost with its
        process; one that did arrive is dropped by the trainer as a duplicate)."""
        with self._lock:
            self.outs[replica].close()
            self.outs[replica] = MessageSender(address, secret=self.secret)
            self.versions.pop(replica, None)
            held, self.unconfirmed[replica], self.in_flight[replica] = self.unconfirmed[replica], {}, {}
            for (index, attempt), problem in held.items():
                self.redispatched += 1
                self._dispatch(index, attempt, problem)
            self._flush()

    def _trace_admission(self, version: int | None, closing: bool = False) -> None:
        """Open a blocked span when prompts remain but the staleness rule lets none start at
        ``version`` (None: not every replica is up, which is not counted); close it when one may."""
        left = self.admission.accepted + self.admission.running < len(self.problems)
        blocked = left and not closing and version is not None and not self.admission.can_admit(version)
        if blocked and self._blocked_since is None:
            self._blocked_since = now_us()
        elif not blocked and self._blocked_since is not None:
            self.trace.complete(self.admission_edge, "admission", self._blocked_since, now_us(), cat="edge",
                                proc=f"edge {self.admission_edge}",
                                wait="admission", admitted=self.admission.accepted + self.admission.running,
                                version=-1 if version is None else version)
            self._blocked_since = None

    def run(self, stop: threading.Event) -> None:
        """Admit and route until ``stop`` is set, then tell every replica to stop."""
        try:
            while not stop.is_set():
                msg = self.control.recv(timeout_s=0.05)
                with self._lock:
                    while msg is not None:
                        self._handle(msg)
                        msg = self.control.recv(timeout_s=0)
                    v = self.min_version
                    self._trace_admission(v)  # closes a blocked span once a new version lets groups in
                    while v is not None and self.admission.accepted + self.admission.running < len(self.problems) \
                            and self.admission.can_admit(v):
                        index = self.admission.admit(v)
                        self._dispatch(index, 1, self.problems[index])
                    self._start_round()
                    self._flush()
                    self._trace_admission(v)  # opens one when the admitted groups filled the capacity
        finally:
            self._trace_admission(None, closing=True)
            self.trace.close()
            for out in self.outs:
                try:
                    out.send(("stop",), timeout_s=1.0)
                except TimeoutError:
                    pass
                out.close()
            self.control.close()
