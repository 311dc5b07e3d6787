"""The ranks of a multi-rank train_step, spawned by the worker that hosts them.

Owns the start of a trainer's ranks (``runtime.parallel_trainer.run_ranks``) from a
worker's spec: the policy's and a critic's settings (or a critic's alone, on a mesh of its own), the ranks of this machine
(``WorkerSpec.ranks``; all of them, or this machine's share when the ranks are spread over
machines on Ray), and a rank's death turned into this process's (the schedulers restart a
dead trainer from its last checkpoint). The stage worker (``runtime.stage_worker``) runs the
ranks holding rank 0; :func:`run_rank_host` runs the ranks of another machine.
"""

from __future__ import annotations

import os
import sys

from runtime.workers import WorkerSpec, worker_context, worker_group


def run_rank_host(spec: WorkerSpec) -> None:
    """The ranks ``spec.ranks`` of the multi-rank trainer ``spec.group`` on a machine other
    than rank 0's (Ray): they join rank 0's ``torch.distributed`` group and follow its
    commands (``runtime.parallel_trainer``) until the trainer ends; a rank's signal ends this
    process as it ends the stage worker (:func:`run_trainer_ranks`)."""
    ctx = worker_context(spec)
    run_trainer_ranks(spec, ctx, worker_group(spec), None, ())


def rank_settings(ctx, group):
    """``(policy settings or None, critic settings or None)`` of the group's multi-rank train_steps,
    or None: no ranks to spawn. The policy's multi-rank train_step brings a critic trained on
    its ranks (its strategy); a group without the policy's trainer spawns ranks for a multi-rank
    critic of its own (``(None, critic settings)``: its mesh, its strategy)."""
    from runtime.executors.train_settings import TrainSettings

    policy = next((n for n in group.batch_nodes if ctx.node(n).trains and ctx.node(n).model == ctx.policy_name()),
                  None)
    critic = next((TrainSettings.from_node(ctx.node(n), ctx) for n in group.nodes if ctx.node(n).trains
                   and ctx.plan.models[ctx.node(n).model]["head"] == "value"
                   and ctx.node(n).parallel.world_size > 1), None)
    if group.strategy.world_size == 1 or (policy is None and critic is None):
        return None
    return (TrainSettings.from_node(ctx.node(policy), ctx) if policy is not None else None), critic


def run_trainer_ranks(spec: WorkerSpec, ctx, group, lead, args: tuple):
    """Spawn the group's ranks (``spec.ranks``' share, or all): rank 0 runs
    ``lead(rank_trainer, *args)`` and its result is returned (None where rank 0 is elsewhere).

    Raises:
        runtime.parallel.launch.WorkerError: a rank raised. (A rank ended by a signal ends
            this process by the same signal.)"""
    from runtime.parallel.launch import RankKilled
    from runtime.parallel_trainer import run_ranks

    settings, critic = rank_settings(ctx, group)
    try:
        return run_ranks(settings, group.strategy, lead, args, spec.recv_timeout_s + 120.0,
                         device_type=spec.plan.device_type, backend=spec.plan.backend, secret=spec.secret,
                         critic=critic, span=spec.ranks)
    except RankKilled as exc:  # die as the rank did: the scheduler restarts the trainer from its checkpoint
        print(f"areal-flow: {spec.group}/{spec.rank}: {exc}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), exc.signal)
        raise
