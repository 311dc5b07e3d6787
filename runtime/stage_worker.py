"""The stage worker: a non-generation worker group, and in the trainer's group the step loop.

Owns :func:`run_stage_worker` (the same code under ``local`` and ``ray``): it joins the
groups arriving from its upstream worker groups by admission index, runs its ``group``
nodes, and either forwards them or — in the group that hosts ``batch`` nodes, the trainer —
takes the ``B`` groups of step ``s`` in admission order
(``runtime.staleness.OrderedExperienceBuffer`` checks every sample's staleness
``s - start_version <= k``), runs the batch nodes (advantage, every train_step), publishes
each trained policy on its weight routes, writes trajectories, checkpoints and the records
of ``debug.record`` (``runtime.record``), times its work (``runtime.trace``) and reports the
step's metrics. A checkpoint (``train.checkpoint_every``; layout and atomic write in
``runtime.checkpoint``; what of a step group goes in: ``runtime.step_checkpoint``) is written after the step's trajectories and metrics
(``run_dir.STEPS_FILE``), and a trainer given one (``WorkerSpec.resume``) continues from it: weights, optimizer,
RNGs, step, version and the state of its batch nodes' ``Checkpointed`` executors. One
loop for every world size: a multi-rank train_step runs it on rank 0
(``runtime.parallel_trainer.run_ranks``). What it shares with the generation replica
(``GroupItem``, ``WorkerSpec``, contexts, group nodes) is ``runtime.workers``.

Several step groups (a critic's ``advantage`` and ``critic_step`` on a mesh of their own)
form a chain (``runtime.topology``, ``compiler.hosting``): each runs the same loop, the first
on the channels' groups, each later one on step ``s``'s whole batch from the one before it,
one message ``("batch", s, items, values, stats, sent_us)`` carrying the step's ``B`` items,
the batch values later groups read (``"node.port"``) and the train_steps' stats so far. Only
the trainer (``Topology.trainer``) logs trajectories, evaluates and reports the step's
metrics (with the stats of the step groups before it); each step group saves its own models
and writes and restores its own part of each checkpoint (``runtime.step_checkpoint``).

A group a ``group`` node drops (a filter) is reported so the router resamples its slot; a
late duplicate of a group already held (sent twice around a replica restart) is dropped and
counted, never trained twice. A restarted replica's ``("resync", weight_address)`` on the
trainer's inbox gets the current version published to it.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch

from areal_flow.dtypes import torch_dtype
from areal_flow.values import Advantages
from runtime.channels import MessageReceiver, MessageSender
from runtime.context import WorkerContext
from runtime.faults import kill_point
from runtime.groups import failure_counts, file_group
from runtime.observe import memory_profile, step_metrics
from runtime.record import EdgeRecorder, check_edges
from runtime.run_dir import STEPS_FILE
from runtime.staleness import OrderedExperienceBuffer
from runtime.step_checkpoint import StepCheckpoints
from runtime.topology import trainer_input
from runtime.trace import TraceRecorder, channel_edge, now_us
from runtime.trainer_ranks import rank_settings, run_trainer_ranks
from runtime.weights_in_process import SCHEME, open_publisher
from runtime.writer_fence import check as check_fence, claim as claim_fence
from runtime.workers import (GroupItem, WorkerSpec, make_executor, run_group_nodes, sync_node, wire_dtype,
                             worker_context, worker_group)

def run_stage_worker(spec: WorkerSpec, report=None, lease=None) -> dict:
    """A non-generation worker group (module doc); ``report(metrics)`` gets each step's
    metrics (a trainer); ``lease`` is held around each train step when the plan time-shares
    the mesh with generation. A multi-rank policy train_step spawns its ranks here (or, its
    ranks spread over machines, ``spec.ranks``: those of this machine, rank 0 among them); when
    one of them is ended by a signal, this process ends by the same signal (a dead trainer,
    which the local scheduler restarts from the last checkpoint, ``runtime.launch``)."""
    group = worker_group(spec)
    ctx = worker_context(spec)
    if rank_settings(ctx, group) is not None:
        return run_trainer_ranks(spec, ctx, group, _stage_on_rank0, (spec, report, lease))
    return _Stage(spec, ctx, group, report, lease).run()


def _stage_on_rank0(rank_trainer, spec: WorkerSpec, report, lease) -> dict:
    ctx = worker_context(spec)
    ctx.rank_trainer = rank_trainer
    return _Stage(spec, ctx, worker_group(spec), report, lease).run()


def trajectory_line(t, step: int) -> str:
    """One ``trajectories.jsonl`` line: trajectory ``t``'s fields read shallowly (``vars``: no deep copy
    on the trainer's critical path), ``step`` and its staleness then, as JSON; a dataclass in them
    (in ``meta``) is written as ``dataclasses.asdict`` writes it."""
    return json.dumps({**vars(t), "step": step, "staleness": t.staleness(step)}, default=_plain)


def _plain(value):
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


class _Stage:
    def __init__(self, spec: WorkerSpec, ctx: WorkerContext, group, report, lease=None) -> None:
        from runtime.topology import build_topology

        self.spec, self.ctx, self.group, self.report = spec, ctx, group, report
        self.lease = lease if lease is not None else contextlib.nullcontext()
        self.topo = build_topology(spec.plan)
        nodes = [ctx.node(n) for n in group.nodes]
        self.group_nodes = [n for n in nodes if n.name not in group.batch_nodes]
        self.batch_nodes = [n for n in nodes if n.name in group.batch_nodes]
        self.executors = {n.name: make_executor(n, ctx) for n in nodes}
        key = spec.secret
        self.inbox, self.control = MessageReceiver(spec.inbox, secret=key), MessageSender(spec.control, secret=key)
        self.outs = [MessageSender(a, secret=key, linger_s=120.0) for a in spec.downstream.values()]
        self.joining: dict[tuple[int, int], list] = {}
        self.version = 0  # policy versions published so far
        self.publishers: dict = {}  # train_step name -> its weight publisher (while training)
        self.engine_dtypes: dict[str, torch.dtype] = {}  # weight address -> its engine's announced dtype
        self._eval = None  # (task, held-out problems) of eval.every
        self.counts = {"groups": 0, "dropped": 0, "duplicates": 0}
        self.checkpoints = StepCheckpoints(self.executors, self.batch_nodes, ctx.policy_name(),
                                           self.topo.batch_groups, int(ctx.plan.run.get("keep_checkpoints", 0)),
                                           spec.group, Path(spec.resume) if spec.resume else None,
                                           chain=tuple(g.name for g in self.topo.step_groups),
                                           trainer=self.topo.trainer.name)
        self.trace = TraceRecorder.for_plan(spec.plan, spec.out_dir, f"{spec.group}/{spec.rank}")
        chain = [g.name for g in self.topo.step_groups]
        at = chain.index(group.name) if group.name in chain else 0
        self.previous = chain[at - 1] if at else None  # the step group this one takes whole batches from
        self.is_trainer = self.topo.trainer.name == group.name  # it logs trajectories and reports the steps
        later = {n for g in chain[at + 1:] for n in self.topo.groups[g].nodes}
        self.passed_on = {f"{src}.{port}" for n in later for src, port in ctx.node(n).inputs.values()}
        self.carried: dict[int, tuple[dict, dict]] = {}  # step -> (batch values, stats) from self.previous
        self.channels = {u: channel_edge(ctx.plan, group.nodes, self.topo.groups[u].nodes) for u in group.upstream
                         if u != self.previous}
        self.lanes = (self.topo.max_staleness + 1) * self.topo.batch_groups  # groups that can wait at once
        recorded = check_edges(ctx.plan, ctx.plan.run.get("debug", {}).get("record", []),
                               [n for g in self.topo.step_groups for n in g.batch_nodes])
        self.records = [EdgeRecorder.start(Path(spec.out_dir), src, dst, port, threads=spec.threads,
                                           seed=ctx.seed, folders=spec.folders)
                        for src, dst, port in recorded if dst in group.batch_nodes]  # each step group its own

    def _receive(self, timeout_s: float) -> list[GroupItem]:
        """The next fully joined, processed item, or the ``B`` items of a step's batch from
        the previous step group (its values and stats kept in :attr:`carried`); none on a
        timeout or a dropped group."""
        with self.spec.cores.lending() if self.spec.cores else contextlib.nullcontext():
            msg = self.inbox.recv(timeout_s=timeout_s)  # waiting: its threads lent (runtime.core_lending)
        if msg is None:
            return []
        if isinstance(msg, tuple) and msg[0] == "resync":
            self._resync(msg[1])
            return []
        if isinstance(msg, tuple) and msg[0] == "engine_dtype":
            self._follow_engine(*msg[1:])
            return []
        if isinstance(msg, tuple) and msg[0] == "batch":
            _, step, items, values, stats, sent_us = msg
            edge = f"{self.previous}->{self.spec.group}"
            self.trace.complete(edge, "batch", sent_us, now_us(), cat="edge", proc=f"edge {edge}", wait="channel",
                                step=step)
            self.carried[step] = (values, stats)
            return items
        if msg.origin in self.channels:
            edge = self.channels[msg.origin]
            self.trace.complete(edge, f"lane {msg.index % self.lanes}", msg.sent_us, now_us(), cat="edge",
                                proc=f"edge {edge}", wait="channel", index=msg.index, attempt=msg.attempt)
        parts = self.joining.setdefault((msg.index, msg.attempt), [])
        parts.append(msg)
        if len(parts) < max(1, len(self.group.upstream)):
            return []
        item = GroupItem(msg.index, msg.attempt)
        for part in self.joining.pop((msg.index, msg.attempt)):
            item.values.update(part.values)
        if not run_group_nodes(item, self.group_nodes, self.executors, self.trace):
            self.counts["dropped"] += 1
            self.control.send(("resample", item.index, item.attempt))
            return []
        return [item]

    def _follow_engine(self, address: str, name: str, fresh: bool) -> None:
        """A replica's engine at weight ``address`` announced its dtype ``name``
        (``runtime.workers.tell_trainer``): its weight matrices go in it from now on, from the
        publisher that serves it and from a resync; one that came after a version had gone out in
        another dtype is kept out, and said on stderr."""
        dtype = torch_dtype(name, f"replica at {address}: engine dtype")
        self.engine_dtypes[address] = dtype
        followed = [p.follow_engine(address, dtype, fresh=fresh) for p in self.publishers.values()]
        if not any(followed) and not address.startswith(SCHEME):
            print(f"{self.spec.group}: the engine at {address} announced {name} after a weight version had gone "
                  "to it in another dtype; its versions keep that one", file=sys.stderr)

    def _resync(self, address: str) -> None:
        """Publish the current policy version to a restarted replica's weight ``address``
        (between steps, the model holds exactly the last published version)."""
        for node in self.batch_nodes:
            if node.trains and node.name in self.spec.routes and self.version > 0:
                publisher = open_publisher(address, secret=self.spec.secret, snapshot=self.topo.max_staleness > 0,
                                           dtype=self.engine_dtypes.get(address, wire_dtype(self.ctx.plan, node.name)),
                                           linger_s=120.0)
                publisher.publish(self.executors[node.name].current_state(), self.version)
                threading.Thread(target=publisher.close, daemon=True).start()  # delivers, then closes
        self.counts["resyncs"] = self.counts.get("resyncs", 0) + 1

    def run(self) -> dict:
        try:
            if not self.batch_nodes:
                while True:
                    for item in self._receive(timeout_s=self.spec.recv_timeout_s):
                        for out in self.outs:
                            out.send(item.stamp(self.spec.group))
            return self._train()
        finally:
            for sock in (*self.outs, self.control):
                sock.close()
            self.inbox.close()
            self.trace.close()

    def _train(self) -> dict:
        topo, out = self.topo, Path(self.spec.out_dir)
        buffer = OrderedExperienceBuffer(topo.batch_groups, topo.max_staleness)
        start = buffer.next_step = self.version = self.checkpoints.restore(Path(self.spec.resume)) if self.spec.resume else 0
        items: dict[int, GroupItem] = {}
        self.publishers = publishers = {
            ts: open_publisher(addrs, secret=self.spec.secret, snapshot=topo.max_staleness > 0,
                               dtype=wire_dtype(self.ctx.plan, ts))
            for ts, addrs in self.spec.routes.items()}  # mem://: in this process (runtime.hybrid)
        checkpoint_every = max((self.ctx.node(n).attrs.get("checkpoint_every", 0) for n in self.group.nodes
                                if self.ctx.node(n).trains), default=0)
        fence = claim_fence(out) if self.is_trainer else ""  # runtime.writer_fence: a given-up attempt stops
        try:
            with self._trajectory_log(out, start) as log:
                for step in range(start, topo.steps):
                    waited, waited_us = time.perf_counter(), now_us()
                    while not buffer.ready(step) or (self.previous is not None and step not in self.carried):
                        got = self._receive(timeout_s=1.0)
                        if not got and time.perf_counter() - waited > self.spec.recv_timeout_s:
                            raise TimeoutError(f"{self.spec.group} step {step}: no experience for "
                                               f"{self.spec.recv_timeout_s} s")
                        for item in got:
                            if self.previous is None:  # held here first: no replica needs to keep it
                                self.control.send(("received", item.index, item.attempt))
                            file_group(item, items, buffer, self.counts, self.ctx.plan)
                    wait_s = time.perf_counter() - waited
                    self.trace.complete(self._batch_edge(), "batch wait", waited_us, now_us(), cat="edge",
                                        wait="batch", step=step)
                    started = time.perf_counter()
                    buffer.take_batch(step)
                    batch_items = [items.pop(i) for i in range(step * topo.batch_groups, (step + 1) * topo.batch_groups)]
                    # every checkpoint_every steps and at the last step (a finished run resumes as complete)
                    checkpoint = bool(checkpoint_every) and ((step + 1) % checkpoint_every == 0 or step + 1 == topo.steps)
                    with self.lease:  # a mesh time-shared with generation: one of them at a time
                        stats, advantage, values = self._batch_step(step, batch_items, publish=step + 1 < topo.steps,
                                                                    checkpoint=checkpoint, publishers=publishers)
                    train_s = time.perf_counter() - started
                    self.counts["groups"] += len(batch_items)
                    for sender in self.outs:  # the next step group of the chain (runtime.topology)
                        passed = {k: v for k, v in values.items() if k in self.passed_on}
                        sender.send(("batch", step, batch_items, passed, stats, now_us()))
                    if fence:
                        check_fence(out, fence, f"step {step}'s records")
                    metrics = None if log is None else self._record_step(step, log, out, advantage, stats,
                                                                          (train_s, wait_s), checkpoint)
                    if checkpoint:  # its own span on the step track: time to accuracy leaves it out (bench/vs_trl_curve)
                        with self.trace.span("checkpoint", "step", cat="io", version=step + 1):
                            written = self.checkpoints.write(step + 1, out / "checkpoints")
                        if not written and metrics:
                            metrics.pop("checkpoint", None)  # written after the step's records; a full disk kept none
                    if metrics is not None and self.report is not None:  # only the trainer reports the step
                        self.report(metrics)
                    self.trace.flush()
            if fence:
                check_fence(out, fence, "the final model")
            self._save_final(out / "model")
        finally:
            for p in publishers.values():
                p.close()
        failed = {"checkpoint_failures": self.checkpoints.failures} if self.checkpoints.failures else {}
        return {**self.counts, **failed, "steps": topo.steps, "consumed": len(buffer.consumed_ids),
                "max_staleness_seen": buffer.max_seen_staleness,
                "world_size": self.group.strategy.world_size, "rejected_messages": self.inbox.rejected,
                **failure_counts(self.executors)}

    def _record_step(self, step: int, log, out: Path, advantage, stats: dict, times: tuple[float, float],
                     checkpoint: bool) -> dict:
        """Write the trainer's records of ``step`` (its trajectories to ``log``, its metrics to
        ``run_dir.STEPS_FILE``); the metrics (``times``: train and wait seconds)."""
        for t in advantage.trajectories:
            log.write(trajectory_line(t, step) + "\n")
        log.flush()
        metrics = step_metrics(step, stats, advantage.batch, advantage.trajectories, *times)
        if checkpoint:
            metrics["checkpoint"] = str(out / "checkpoints" / f"version_{step + 1}")
        every = int(self.ctx.plan.run.get("eval", {}).get("every", 0) or 0)
        if every and (step + 1) % every == 0 and step + 1 < self.topo.steps:
            metrics["eval/accuracy"] = self._held_out_accuracy()
        if self.ctx.plan.run.get("debug", {}).get("memory_profiler"):
            memory_profile(step, out / "memory.jsonl", [self.executors[n.name] for n in self.batch_nodes if n.trains],
                           cuda=self.ctx.plan.device_type == "cuda")
        with (out / STEPS_FILE).open("a") as fh:
            fh.write(json.dumps(metrics) + "\n")
        return metrics

    def _trajectory_log(self, out: Path, start: int):
        """The trainer's ``trajectories/trajectories.jsonl`` (appended to from a resumed
        ``start``); another step group writes none (a null context giving None)."""
        if not self.is_trainer:
            return contextlib.nullcontext()
        (out / "trajectories").mkdir(parents=True, exist_ok=True)
        if not start:
            (out / STEPS_FILE).write_text("")
        return (out / "trajectories" / "trajectories.jsonl").open("a" if start else "w")

    def _held_out_accuracy(self) -> float:
        """Greedy accuracy of the current policy on the run's held-out problems (``eval.n_test``),
        measured in this worker between steps (``eval.every``)."""
        from areal_flow.tasks.catalog import build_task
        from runtime.evaluate import answer_accuracy, greedy_answers
        from runtime.model_source import load_pretrained

        plan = self.ctx.plan
        if self._eval is None:
            task = build_task(self.topo.dataset.attrs, plan.run["seed"])
            self._eval = (task, task.test_set(plan.run["eval"]["n_test"]))
        task, problems = self._eval
        node = next(n for n in self.batch_nodes if n.trains and n.model == self.ctx.policy_name())
        executor, folder = self.executors[node.name], self.ctx.folders[node.model]
        model, _ = load_pretrained(folder)
        model.load_state_dict(executor.current_state())
        gen = self.ctx.generator()
        if gen.multi_turn:
            from runtime.evaluate import evaluate_episodes
            from runtime.executors.episode_failures import LOG_NAME
            from runtime.executors.rollout import episode_context

            limit = episode_context(gen.attrs, folder)
            return evaluate_episodes(model, self.ctx.tokenizer, gen.attrs, problems, max_context=limit,
                                     temperature=float(plan.run["eval"].get("temperature", 0.0)),
                                     failure_log=self.ctx.out_dir / LOG_NAME)["accuracy"]
        answers = greedy_answers(model, self.ctx.tokenizer, task, problems,
                                 chat_template=self.topo.generate.attrs.get("chat_template"))
        return answer_accuracy(task, answers, problems)

    def _batch_step(self, step: int, batch_items: list[GroupItem], *, publish: bool, checkpoint: bool,
                    publishers: dict) -> tuple[dict, Advantages | None, dict]:
        """Run the batch nodes on the step's groups; the train_steps' metrics (after those the
        previous step groups sent), the ``Advantages`` the (last) train_step here trained on
        (None: none trains here) and every batch value (``"node.port"``) so far."""
        carried, before = self.carried.pop(step, ({}, {}))
        values: dict = dict(carried)
        stats: dict = dict(before)
        advantage = None
        indices, samples = [it.index for it in batch_items], [len(it.rollouts(self.ctx.plan)) for it in batch_items]
        for node in self.batch_nodes:
            inputs = {}
            for port, (src, src_port) in node.inputs.items():
                key = f"{src}.{src_port}"
                inputs[port] = values[key] if key in values else [it.values[key] for it in batch_items]
            is_step = node.trains
            info = {"step": step, "publish": is_step and (publish and node.name in publishers or checkpoint),
                    "trace": self.trace, "indices": indices, "samples": samples}
            for record in self.records:
                if record.dst == node.name:
                    record.item(step, inputs[record.port], [it.index for it in batch_items],
                                [it.attempt for it in batch_items], [t for it in batch_items for t in it.rollouts(
                                    self.ctx.plan)])
            with self.trace.span(node.name, "step", step=step, version=self.version):
                result = self.executors[node.name].run(inputs, info)
            values.update({f"{node.name}.{port}": v for port, v in result.items()})
            if is_step:
                stats.update(result["stats"].metrics)
                advantage, weights = inputs[trainer_input(node)], result["weights"].state
                self._digest(step, node, weights)
                if publish and node.name in publishers:
                    publisher, sent, started = publishers[node.name], publishers[node.name].published_bytes, \
                        time.perf_counter()
                    with self.trace.span(sync_node(self.ctx.plan, node.name), "weights", phase="publish",
                                         version=step + 1):
                        publisher.publish(weights, step + 1)
                    kill_point(self.ctx.plan, self.spec.out_dir, f"{self.spec.group}/{self.spec.rank}",
                               "weights_published", step + 1)
                    self.version = step + 1
                    stats["weights/sync_s"] = time.perf_counter() - started
                    stats["weights/bytes"] = float(publisher.published_bytes - sent)
                if checkpoint:
                    self.checkpoints.to_save[node.name] = weights
        return stats, advantage, values

    def _batch_edge(self) -> str:
        """The edge the trainer waits on for its batch: into its first batch node, from the
        latest node (plan order) feeding it."""
        first = self.batch_nodes[0]
        order = {n.name: i for i, n in enumerate(self.ctx.plan.nodes)}
        return f"{max((src for src, _ in first.inputs.values()), key=order.__getitem__)}->{first.name}"

    def _digest(self, step: int, node, weights) -> None:
        """Record the weights of train_step ``node`` after ``step`` for every recorded edge
        that replays it (its ``dst`` runs at or before ``node``)."""
        names = [n.name for n in self.batch_nodes]
        for record in self.records:
            if names.index(record.dst) <= names.index(node.name):
                record.digest(step, node.name, weights if weights is not None else
                              self.executors[node.name].current_state())

    def _save_final(self, folder: Path) -> None:
        for node in self.batch_nodes:
            if node.trains:
                ex = self.executors[node.name]
                path = folder if node.model == self.ctx.policy_name() else folder.parent / node.model
                ex.save(path, ex.final_state())
