"""The hybrid worker: a generation replica and the trainer in ONE process (local scheduler).

When the plan time-shares the generation mesh with the trainer (``gen:d1 | train:d1``: ``|``
in ``compiler.allocation``) and both are one process each — one generation replica, a
one-rank trainer group of one worker — and ``scheduler.hybrid`` is true (opt-in: not
faster than two processes on the shared 2-core box, docs/PERFORMANCE.md), the local scheduler
(``runtime.launch``) starts one process for the two (what verl calls a hybrid engine): the trainer's loop
(``runtime.stage_worker.run_stage_worker``) in its main thread, the replica's
(``runtime.workers.run_generation_replica``) in a second thread, a ``threading.Lock`` as the
lease held around each engine step and each train step, and their weight channel in memory
(``runtime.weights_in_process``: ``mem://`` addresses, no serialisation). The two loops are
the same code as in two processes; their other channels stay ZeroMQ ``ipc://``.

Only one of them computes at a time; each thread gets every torch thread the scheduler
gives a worker at k = 0. libgomp keeps one OpenMP team per calling thread, so the waiting
thread's team would spin on the cores the other needs, as a second process's does: the
process starts with ``OMP_WAIT_POLICY=PASSIVE`` (after a short spin, ``runtime.worker_env.OMP_SPIN``) like every local worker (libgomp's default
spin made its RL loop 1.5x as long as two PASSIVE processes' on the shared 2-core box:
docs/PERFORMANCE.md).

What stays two processes (or more): several generation replicas, a trainer of several ranks
or processes, a mesh time-shared by other groups (a critic's step group), a vLLM engine
(``gen.engine=vllm``: not tried in a thread), and the Ray scheduler (two actors; ``compiler.hosting``). A crash or kill of either loop ends the whole
process: the driver sees the trainer die and restarts every worker from the last checkpoint
(``runtime.driver``), as for a dead trainer in two processes.
"""

from __future__ import annotations

import threading

from runtime.topology import Topology, WorkerGroup
from runtime.weights_in_process import SCHEME


def why_not_hybrid(topo: Topology) -> str | None:
    """Why one process cannot host the generation replica and the trainer (module doc), or None when it can."""
    gen, trainer = topo.generation, topo.trainer
    others = [g for g in topo.groups.values() if g.kind != "generation" and g.mesh == gen.mesh]
    if not others:
        return "the allocation gives generation a mesh of its own (time-share it: 'gen:d1 | train:d1')"
    if others != [trainer]:
        return f"the generation mesh is time-shared by {', '.join(sorted(g.name for g in others))}, not the trainer alone"
    if gen.replicas != 1 or trainer.replicas != 1 or trainer.strategy.world_size != 1:
        return "it holds several generation replicas or trainer ranks"
    if topo.generate.attrs.get("engine", "embedded") != "embedded":  # vLLM runs its own processes and loop
        return "the vLLM engine runs processes of its own"
    return None


def hybrid_pair(topo: Topology) -> tuple[WorkerGroup, WorkerGroup] | None:
    """``(generation group, trainer group)`` when one process hosts both (module doc), else None."""
    return None if why_not_hybrid(topo) else (topo.generation, topo.trainer)


def in_memory_weights(addresses: dict[str, list[str]], sock: str) -> None:
    """Give the generation replica's weight channel a ``mem://`` address (in this attempt's
    socket folder's name, so each attempt has its own slot; ``runtime.weights_in_process``)."""
    addresses["weights"] = [f"{SCHEME}{sock}/weights-0"]


def run_hybrid(gen_spec, train_spec, report, lease: threading.Lock, done) -> None:
    """Run the replica of ``gen_spec`` in a thread and the trainer of ``train_spec`` here,
    sharing ``lease``; ``done(spec, work)`` runs ``work()`` and files its report or error under
    the spec's worker name (a None report: nothing; ``runtime.launch``) and says whether it
    returned. Returns when both ended; when the trainer raised, without waiting for the
    replica (the driver stops the process). Models are loaded one at a time
    (``runtime.model_source.load_pretrained``'s lock)."""
    from runtime.stage_worker import run_stage_worker
    from runtime.workers import run_generation_replica

    if not done(train_spec, lambda: _import_executors(gen_spec, train_spec)):
        return
    replica = threading.Thread(target=done, args=(gen_spec, lambda: run_generation_replica(gen_spec, lease)),
                               name=f"{gen_spec.group}/{gen_spec.rank}", daemon=True)
    replica.start()
    if done(train_spec, lambda: run_stage_worker(train_spec, report, lease)):
        replica.join()


def _import_executors(*specs) -> None:
    """Import the executors of the specs' nodes in this thread before two threads build them:
    two threads importing one module at once can see it half initialised (transformers' lazy
    module did). Returns None (nothing to report)."""
    from areal_flow.ops.registry import lookup
    from runtime.plan_ops import register_plan_ops
    from runtime.workers import worker_group

    register_plan_ops(specs[0].plan)
    ops = {n.name: n.op for n in specs[0].plan.nodes}
    for spec in specs:
        for name in worker_group(spec).nodes:
            lookup(ops[name]).load_executor()
