"""The generation replica, and what every worker shares (items, specs, contexts, group nodes).

Owns what a worker process (or Ray actor) does with its share of the plan; the same code
runs under ``local`` and ``ray`` (``runtime.launch``, ``runtime.ray_scheduler``). The other
worker loop, a stage worker and the trainer's step loop, is ``runtime.stage_worker``.

:func:`run_generation_replica` takes prompt groups from the router (one message per
admission pass), generates them with the ``generate`` node's executor (continuous
batching), runs the ``group`` nodes placed with it on each finished group (calls), and
sends the group's values to the next worker groups (channels). Between engine steps it
polls the weight channel: a new version pauses in-flight sequences, loads and resumes them
(nothing is discarded), and is reported to the router, which admits by it. Engine steps,
group nodes and weight receive/load are spans of its timeline (``runtime.trace``).

What happens to one group (its nodes, its failed samples, its filing for a step) is
``runtime.groups``. A group a ``group`` node drops (a filter, or no sample left after
failed rewards) is reported so the router resamples its slot. A restarted replica gets the trainer's current version (``("resync", weight_address)`` on
the trainer's inbox) and waits for it before it reports ready, so the groups the router
sends it again keep the staleness bound; so does every replica of a resumed run. Whenever a
replica holds a new version its sampling generator is re-seeded from ``(seed, replica,
version)`` (``runtime.checkpoint.sampling_seed``; the embedded engine), so a resumed
``k = 0`` run samples what an uninterrupted one does.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from areal_flow.dtypes import ENGINE, torch_dtype, wire_dtype_name
from areal_flow.ops.function import FunctionExecutor
from areal_flow.ops.interfaces import Executor, StreamExecutor
from areal_flow.ops.registry import STREAM, lookup
from compiler.plan import Plan, decode_value
from runtime.plan_ops import register_plan_ops
from runtime.channels import MessageReceiver, MessageSender, wait_any
from runtime.checkpoint import sampling_seed
from runtime.context import WorkerContext
from runtime.core_lending import CoreShare
from runtime.engines.precision import MIN_SPEEDUP
from runtime.faults import kill_point
from runtime.groups import GroupItem, failure_counts, run_group_nodes
from runtime.parallel.launch import RankSpan
from runtime.topology import judge_nodes
from runtime.trace import TraceRecorder, now_us
from runtime.weights_in_process import SCHEME, open_subscriber


@dataclass
class WorkerSpec:
    """What one worker needs: the plan, the model folders, its group and rank, addresses.

    Attributes:
        inbox: address it binds (prompts for a replica, groups for a stage worker).
        control: the router's address. downstream: group name -> its inbox address.
        weights: a replica's weight-channel address (it binds); routes: for a trainer,
            train_step name -> the weight addresses of every replica of its target.
        threads: torch intra-op threads. recv_timeout_s: seconds without experience
            before a trainer gives up.
        resume_version: a restarted replica waits for this policy version on its weight
            channel before it reports ready (its groups were admitted at versions up to
            it, so the staleness proof needs their tokens from versions >= it).
        resync: a restarted replica's trainer inbox: once its weight channel is bound it
            asks there for the current version (``("resync", weights)``).
        trainer: a replica's trainer inbox, where it announces the dtype its engine chose when
            the plan's ``weights_dtype`` is ``engine`` (:func:`tell_trainer`).
        secret: the run's channel secret (``runtime.channel_auth``): every message it sends
            is signed with it, every message it receives is verified before use.
        resume: for a trainer, the checkpoint folder it continues from (``runtime.checkpoint``;
            empty: version 0).
        cores: its slot in the local scheduler's core ledger (``runtime.core_lending``): it lends
            its threads while it waits and takes the lent ones while it computes; None: its
            threads stay ``threads``.
        ranks: for a multi-rank trainer whose ranks are spread over machines (Ray), the ranks
            this worker spawns and their rendezvous (``runtime.parallel.launch.RankSpan``);
            None: every rank, here.
    """

    plan: Plan
    folders: dict
    out_dir: str
    group: str
    rank: int
    inbox: str
    control: str
    downstream: dict = field(default_factory=dict)
    weights: str = ""
    routes: dict = field(default_factory=dict)
    threads: int = 1
    recv_timeout_s: float = 600.0
    resume_version: int = 0
    resync: str = ""
    trainer: str = ""
    secret: bytes = b""
    resume: str = ""
    ranks: RankSpan | None = None
    cores: CoreShare | None = None


def worker_context(spec: WorkerSpec) -> WorkerContext:
    """The context of the worker ``spec`` describes: its torch threads, the seed ``seed + rank``,
    the plan's ops registered and node attributes decoded."""
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.plan.run["seed"] + spec.rank)
    register_plan_ops(spec.plan)
    plan = spec.plan
    decoded = tuple(n.__class__(**{**n.__dict__, "attrs": decode_value(n.attrs)}) for n in plan.nodes)
    plan = plan.__class__(**{**plan.__dict__, "nodes": decoded})
    return WorkerContext(plan, spec.folders, Path(spec.out_dir), rank=spec.rank, threads=spec.threads, cores=spec.cores)


def make_executor(node, ctx: WorkerContext) -> Executor | StreamExecutor:
    """The executor of plan node ``node`` in this worker (``areal_flow.ops.interfaces``): its
    op's executor class built as ``cls(node, ctx)``, or a user op's function wrapped; a
    generate node fed by a per-group node (``runtime.topology.judge_nodes``) run per group
    (``runtime.executors.fed_generate``)."""
    op = lookup(node.op)
    impl = op.load_executor()
    executor = impl(node, ctx) if isinstance(impl, type) else FunctionExecutor(impl, node, ctx)
    if op.grain == STREAM and node.name in judge_nodes(ctx.plan):
        from runtime.executors.fed_generate import FedGenerateExecutor

        return FedGenerateExecutor(executor)
    return executor


def run_generation_replica(spec: WorkerSpec, lease=None) -> dict:
    """Replica ``spec.rank`` of the generation group, until the router says stop. ``lease``: a
    lock held around each engine step when the plan time-shares this mesh with a trainer
    (``|`` in the allocation)."""
    ctx = worker_context(spec)
    nodes = [ctx.node(n) for n in worker_group(spec).nodes]
    gen = make_executor(next(n for n in nodes if n.grain == STREAM), ctx)
    precision = engine_precision(spec, gen)
    local = [n for n in nodes if n.grain != STREAM]
    executors = {n.name: make_executor(n, ctx) for n in local}
    key = spec.secret
    inbox, control = MessageReceiver(spec.inbox, secret=key), MessageSender(spec.control, secret=key)
    by_address = {a: MessageSender(a, secret=key, linger_s=120.0) for a in dict.fromkeys(spec.downstream.values())}
    outs = [by_address[a] for a in spec.downstream.values()]
    weights = open_subscriber(spec.weights, secret=key)  # mem://: the hybrid worker's (runtime.hybrid)
    counts = {"groups": 0, "dropped": 0, "weight_updates": 0}
    trace = TraceRecorder.for_plan(spec.plan, spec.out_dir, f"{spec.group}/{spec.rank}")
    sync = sync_node(spec.plan, gen.node.name)
    engine_steps, cores = 0, spec.cores
    to_trainer = tell_trainer(spec, gen, sync, by_address)
    if spec.resume_version > 0:
        update = weights.wait(min_version=spec.resume_version, timeout_s=spec.recv_timeout_s)
        if update is None:
            raise TimeoutError(f"restarted replica {spec.rank}: policy version {spec.resume_version} did not arrive "
                               f"on {spec.weights} within {spec.recv_timeout_s} s")
        gen.update_weights(update[1], update[0])
        counts["weight_updates"] += 1
    seed_sampling(gen, spec)
    control.send(("ready", spec.rank, gen.version))
    stop = False
    try:
        while not stop:
            started = now_us()
            update = weights.poll()
            if update is not None:
                kill_point(spec.plan, spec.out_dir, f"{spec.group}/{spec.rank}", "weights_received", update[0])
                trace.complete(sync, "weights", started, now_us(), phase="receive", version=update[0])
                with trace.span(sync, "weights", phase="load", version=update[0]):
                    gen.update_weights(update[1], update[0])
                seed_sampling(gen, spec)
                counts["weight_updates"] += 1
                control.send(("version", spec.rank, gen.version))
            if not gen.has_work():  # idle: wake on a prompt or on new weights, whichever comes first
                with cores.lending() if cores else contextlib.nullcontext():
                    wait_any([inbox, weights], timeout_s=0.05)
            msg = inbox.recv(timeout_s=0)
            while msg is not None:
                if msg[0] == "stop":
                    stop = True
                    break
                for index, attempt, problem in msg[1]:  # ("groups", [...]): one admission pass
                    gen.submit(index, attempt, problem)
                msg = inbox.recv(timeout_s=0)
            if stop or not gen.has_work():
                continue
            with lease if lease is not None else contextlib.nullcontext():
                started = now_us()
                finished = gen.step()
            trace.complete(gen.node.name, "engine", started, now_us(), step=engine_steps, version=gen.version,
                           finished=[index for index, _, _ in finished],
                           **gen.occupancy())
            engine_steps += 1
            for index, attempt, trajectories in finished:
                item = GroupItem(index, attempt, {f"{gen.node.name}.rollouts": trajectories})
                if not trajectories or not run_group_nodes(item, local, executors, trace):  # no episode survived
                    counts["dropped"] += 1
                    control.send(("dropped", spec.rank, index, attempt))
                    continue
                for out in outs:
                    out.send(item.stamp(spec.group))
                counts["groups"] += 1
                control.send(("sent", spec.rank, index, attempt))
    finally:
        own = [to_trainer] if to_trainer is not None and to_trainer not in by_address.values() else []
        for sock in (*by_address.values(), control, *own):
            sock.close()
        inbox.close()
        weights.close()
        trace.close()
        gen.close()  # its engine, a rollout's agent endpoint
    return {**counts, **gen.report(), **precision, "final_version": gen.version,
            "weights_late_versions": weights.late_versions, "rejected_messages": inbox.rejected + weights.rejected,
            **failure_counts(executors)}


def engine_precision(spec: WorkerSpec, gen: StreamExecutor) -> dict:
    """Say on stderr which dtype replica ``spec.rank``'s engine decodes in: for the embedded
    engine's ``gen.dtype=auto`` the choice and its measured decode-step speedup
    (``runtime.engines.precision``); and warn when it is not float32 while a trainer's
    ``train.loss.use_decoupled_loss`` is false (the behavior log-probs are then the PPO
    reference: docs/PERFORMANCE.md). Returns ``engine_dtype`` (and ``engine_dtype_speedup``,
    fp32 seconds / 16-bit seconds of one decode step) for the replica's summary."""
    engine = gen.engine
    dtype = engine.dtype
    name, where = str(dtype).removeprefix("torch."), f"generate '{gen.node.name}' replica {spec.rank}"
    out = {"engine_dtype": name}
    speedup = engine.dtype_speedup
    if speedup is not None:
        out["engine_dtype_speedup"] = round(speedup, 3)
        low = "float16" if str(engine.device).startswith("cuda") else "bfloat16"
        print(f"{where}: gen.dtype=auto chose {name} ({low} decode step {speedup:.2f}x as fast as float32; "
              f"{MIN_SPEEDUP}x needed)", file=sys.stderr)
    coupled = [n.name for n in spec.plan.nodes if n.trains
               and not n.attrs.get("loss", {}).get("use_decoupled_loss", False)]
    if dtype != torch.float32 and coupled:
        print(f"{where}: warning: the engine decodes in {name} while train.loss.use_decoupled_loss is false "
              f"(train_step '{coupled[0]}'): its behavior log-probs, off from the trainer's float32 "
              "ones, are then the PPO reference (docs/PERFORMANCE.md); set use_decoupled_loss=true or gen.dtype=float32", file=sys.stderr)
    return out


def tell_trainer(spec: WorkerSpec, gen: StreamExecutor, sync: str,
                 senders: dict[str, MessageSender] | None = None) -> MessageSender | None:
    """What replica ``spec.rank`` (weights through route node ``sync``) says to its trainer once
    its weight channel is bound, in this order on one socket: the dtype its engine chose
    (``("engine_dtype", weights, name, fresh)``) when the plan's ``weights_dtype`` is ``engine``
    and the channel is a wire (not ``mem://``), so the trainer sends the weight matrices in it
    (``WeightPublisher.follow_engine``; ``fresh``: a restarted replica, whose subscriber starts
    anew); then, restarted, the request for the current version (``("resync", weights)``).
    Returns the sender (None: nothing to say), for the caller to close when the replica ends:
    ZeroMQ delivers in the background once the trainer has bound (a resumed one may bind later),
    and ``close`` waits at most 120 s for what is still queued. ``senders`` (address -> the
    replica's experience senders): the one to the same inbox is used, so the dtype arrives before
    the replica's first trajectory (one ZeroMQ socket keeps its messages in order; a socket of its
    own raced the experience, and a version could go out before the announcement)."""
    messages = []
    if spec.trainer and not spec.weights.startswith(SCHEME) and \
            any(n.name == sync and wire_dtype_name(n.attrs.get("weights_dtype")) == ENGINE for n in spec.plan.nodes):
        messages.append(("engine_dtype", spec.weights, str(gen.engine.dtype).removeprefix("torch."), bool(spec.resync)))
    if spec.resync:  # bound above, so the trainer's answer cannot be lost
        messages.append(("resync", spec.weights))
    if not messages:
        return None
    target = spec.resync or spec.trainer
    to = (senders or {}).get(target) or MessageSender(target, secret=spec.secret, linger_s=120.0)
    for message in messages:
        to.send(message)
    return to


def seed_sampling(gen, spec: WorkerSpec) -> None:
    """Re-seed the sampling generator of ``gen``'s engine for the version it now holds
    (``runtime.checkpoint.sampling_seed``; vLLM, whose stream is fixed at start, keeps it)."""
    gen.engine.reseed(sampling_seed(int(spec.plan.run["seed"]), spec.rank, gen.version))


def sync_node(plan: Plan, end: str) -> str:
    """The name of the route node (``sync_weights``) on a weight edge from or to node ``end``
    (a trainer or a generator): the name of the weight spans (``"weights"`` when it has none)."""
    return next((e.dst if e.src == end else e.src for e in plan.edges if e.kind == "weights" and end in (e.src, e.dst)),
                "weights")


def wire_dtype(plan: Plan, trainer: str) -> torch.dtype | None:
    """The dtype trainer ``trainer``'s floating weights are published in: the ``weights_dtype``
    its ``sync_weights`` nodes carry (``compiler.program``) when they all name one, else None
    (each tensor's own; also for a plan written before that attribute, and for ``engine`` until
    an engine has announced its dtype: :func:`tell_trainer`).

    Raises:
        ValueError: a ``weights_dtype`` that names no dtype (naming the node).
    """
    syncs = {e.dst for e in plan.edges if e.kind == "weights" and e.src == trainer}
    dtypes = {torch_dtype(n.attrs["weights_dtype"], f"plan node '{n.name}': weights_dtype")
              if n.attrs.get("weights_dtype") is not None and wire_dtype_name(n.attrs["weights_dtype"]) != ENGINE
              else None for n in plan.nodes if n.name in syncs}
    return dtypes.pop() if len(dtypes) == 1 else None


def worker_group(spec: WorkerSpec):
    """The plan's worker group ``spec`` belongs to (``runtime.topology``)."""
    from runtime.topology import build_topology

    return build_topology(spec.plan).groups[spec.group]
