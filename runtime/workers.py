"""The two worker loops every scheduler runs: a generation replica and a stage worker.

Owns what a worker process (or Ray actor) does with its share of the plan; the same code
runs under ``local`` and ``ray`` (``runtime.launch``, ``runtime.ray_scheduler``).

* :func:`run_generation_replica`: takes prompt groups from the router, generates them
  with the ``generate`` node's executor (continuous batching), runs the ``group`` nodes
  placed with it on each finished group (calls), and sends the group's values to the next
  worker groups (channels). Between engine steps it polls the weight channel: a new
  version pauses in-flight sequences, loads and resumes them (nothing is discarded), and
  is reported to the router, which admits by it.
* :func:`run_stage_worker`: joins the groups arriving from its upstream worker groups by
  admission index, runs its ``group`` nodes, and either forwards them or — in the group
  that hosts ``batch`` nodes, the trainer — takes the ``B`` groups of step ``s`` in
  admission order (``runtime.staleness.OrderedExperienceBuffer`` checks every sample's
  staleness ``s - start_version <= k``), runs the batch nodes (advantage, every
  train_step), publishes each trained policy on its weight routes, writes trajectories and
  checkpoints, and reports the step's metrics. One loop for every world size: a
  multi-rank train_step runs it on rank 0 (``runtime.parallel_trainer.run_ranks``).

What happens to one group (its nodes, its failed samples, its filing for a step) is
``runtime.groups``. A group a ``group`` node drops (a filter, or no sample left after
failed rewards) is reported so the router resamples its slot;
a late duplicate of a group already held (sent twice around a replica restart) is dropped
and counted, never trained twice. A restarted replica gets the trainer's current version
(``("resync", weight_address)`` on the trainer's inbox) and waits for it before it reports
ready, so the groups the router sends it again keep the staleness bound.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from areal_flow.ops.registry import FunctionExecutor, lookup
from compiler.plan import Plan, decode_value
from runtime.channels import MessageReceiver, MessageSender, wait_any
from runtime.context import WorkerContext
from runtime.groups import GroupItem, failure_counts, file_group, run_group_nodes
from runtime.observe import memory_profile, step_metrics
from runtime.staleness import OrderedExperienceBuffer
from runtime.weights import WeightPublisher, WeightSubscriber


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
        secret: the run's channel secret (``runtime.channel_auth``): every message it sends
            is signed with it, every message it receives is verified before use.
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
    secret: bytes = b""


def register_plan_ops(plan: Plan) -> None:
    """Register the user ops the plan carries (so their executors can be built here)."""
    from areal_flow.ops.registry import define

    for encoded in plan.ops.values():
        define(decode_value(encoded))


def _context(spec: WorkerSpec) -> WorkerContext:
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.plan.run["seed"] + spec.rank)
    register_plan_ops(spec.plan)
    plan = spec.plan
    decoded = tuple(n.__class__(**{**n.__dict__, "attrs": decode_value(n.attrs)}) for n in plan.nodes)
    plan = plan.__class__(**{**plan.__dict__, "nodes": decoded})
    return WorkerContext(plan, spec.folders, Path(spec.out_dir), rank=spec.rank, threads=spec.threads)


def make_executor(node, ctx: WorkerContext):
    impl = lookup(node.op).load_executor()
    return impl(node, ctx) if isinstance(impl, type) else FunctionExecutor(impl, node, ctx)


def run_generation_replica(spec: WorkerSpec, lease=None) -> dict:
    """Replica ``spec.rank`` of the generation group, until the router says stop. ``lease``: a
    lock held around each engine step when the plan time-shares this mesh with a trainer
    (``|`` in the allocation)."""
    ctx = _context(spec)
    nodes = [ctx.node(n) for n in _group(spec).nodes]
    gen = make_executor(next(n for n in nodes if n.grain == "stream"), ctx)
    local = [n for n in nodes if n.grain != "stream"]
    executors = {n.name: make_executor(n, ctx) for n in local}
    key = spec.secret
    inbox, control = MessageReceiver(spec.inbox, secret=key), MessageSender(spec.control, secret=key)
    outs = [MessageSender(a, secret=key, linger_s=120.0) for a in spec.downstream.values()]
    weights = WeightSubscriber(spec.weights, secret=key)
    counts = {"groups": 0, "dropped": 0, "weight_updates": 0}
    if spec.resync:  # bound above, so the trainer's answer cannot be lost
        ask = MessageSender(spec.resync, secret=key)
        ask.send(("resync", spec.weights))
        ask.close()
    if spec.resume_version > 0:
        update = weights.wait(min_version=spec.resume_version, timeout_s=spec.recv_timeout_s)
        if update is None:
            raise TimeoutError(f"restarted replica {spec.rank}: policy version {spec.resume_version} did not arrive "
                               f"on {spec.weights} within {spec.recv_timeout_s} s")
        gen.update_weights(update[1], update[0])
        counts["weight_updates"] += 1
    control.send(("ready", spec.rank, gen.version))
    stop = False
    try:
        while not stop:
            update = weights.poll()
            if update is not None:
                gen.update_weights(update[1], update[0])
                counts["weight_updates"] += 1
                control.send(("version", spec.rank, gen.version))
            if not gen.has_work():  # idle: wake on a prompt or on new weights, whichever comes first
                wait_any([inbox, weights], timeout_s=0.05)
            msg = inbox.recv(timeout_s=0)
            while msg is not None:
                if msg[0] == "stop":
                    stop = True
                    break
                gen.submit(*msg[1:])
                msg = inbox.recv(timeout_s=0)
            if stop or not gen.has_work():
                continue
            with lease if lease is not None else contextlib.nullcontext():
                finished = gen.step()
            for index, attempt, trajectories in finished:
                item = GroupItem(index, attempt, {f"{gen.node.name}.rollouts": trajectories})
                if not trajectories or not run_group_nodes(item, local, executors):  # no episode of it survived
                    counts["dropped"] += 1
                    control.send(("dropped", spec.rank, index, attempt))
                    continue
                for out in outs:
                    out.send(item)
                counts["groups"] += 1
                control.send(("sent", spec.rank, index, attempt))
    finally:
        for sock in (*outs, control):
            sock.close()
        inbox.close()
        weights.close()
        if hasattr(gen, "close"):  # e.g. a rollout's agent endpoint
            gen.close()
    return {**counts, **getattr(gen, "counts", {}), "final_version": gen.version,
            "weights_late_versions": weights.late_versions, "rejected_messages": inbox.rejected + weights.rejected,
            **failure_counts(executors)}


def _group(spec: WorkerSpec):
    from runtime.topology import build_topology

    return build_topology(spec.plan).groups[spec.group]


def run_stage_worker(spec: WorkerSpec, report=None, lease=None) -> dict:
    """A non-generation worker group (module doc); ``report(metrics)`` gets each step's
    metrics (a trainer); ``lease`` is held around each train step when the plan time-shares
    the mesh with generation. A multi-rank policy train_step spawns its ranks here."""
    group = _group(spec)
    if group.batch_nodes and group.strategy.world_size > 1:
        from runtime.executors.train import TrainSettings
        from runtime.parallel_trainer import run_ranks

        ctx = _context(spec)
        policy = next(n for n in group.nodes if ctx.node(n).op == "train_step" and ctx.node(n).model ==
                      ctx.policy_name())
        settings = TrainSettings.from_node(ctx.node(policy), ctx)
        return run_ranks(settings, group.strategy, _stage_on_rank0, (spec, report, lease), spec.recv_timeout_s + 120.0,
                         device_type=spec.plan.device_type, backend=spec.plan.backend)
    return _Stage(spec, _context(spec), group, report, lease).run()


def _stage_on_rank0(rank_trainer, spec: WorkerSpec, report, lease) -> dict:
    ctx = _context(spec)
    ctx.rank_trainer = rank_trainer
    return _Stage(spec, ctx, _group(spec), report, lease).run()


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
        self._eval = None  # (task, held-out problems) of eval.every
        self.counts = {"groups": 0, "dropped": 0, "duplicates": 0}

    def _receive(self, timeout_s: float) -> GroupItem | None:
        """The next fully joined, processed item (None on timeout or a dropped group)."""
        msg = self.inbox.recv(timeout_s=timeout_s)
        if msg is None:
            return None
        if isinstance(msg, tuple) and msg[0] == "resync":
            self._resync(msg[1])
            return None
        parts = self.joining.setdefault((msg.index, msg.attempt), [])
        parts.append(msg)
        if len(parts) < max(1, len(self.group.upstream)):
            return None
        item = GroupItem(msg.index, msg.attempt)
        for part in self.joining.pop((msg.index, msg.attempt)):
            item.values.update(part.values)
        if not run_group_nodes(item, self.group_nodes, self.executors):
            self.counts["dropped"] += 1
            self.control.send(("resample", item.index, item.attempt))
            return None
        return item

    def _resync(self, address: str) -> None:
        """Publish the current policy version to a restarted replica's weight ``address``
        (between steps, the model holds exactly the last published version)."""
        for node in self.batch_nodes:
            if node.op == "train_step" and node.name in self.spec.routes and self.version > 0:
                publisher = WeightPublisher(address, secret=self.spec.secret, linger_s=120.0)
                publisher.publish(self.executors[node.name].current_state(), self.version)
                threading.Thread(target=publisher.close, daemon=True).start()  # delivers, then closes
        self.counts["resyncs"] = self.counts.get("resyncs", 0) + 1

    def run(self) -> dict:
        try:
            if not self.batch_nodes:
                while True:
                    item = self._receive(timeout_s=self.spec.recv_timeout_s)
                    if item is not None:
                        for out in self.outs:
                            out.send(item)
            return self._train()
        finally:
            for sock in (*self.outs, self.control):
                sock.close()
            self.inbox.close()

    def _train(self) -> dict:
        topo, out = self.topo, Path(self.spec.out_dir)
        buffer = OrderedExperienceBuffer(topo.batch_groups, topo.max_staleness)
        items: dict[int, GroupItem] = {}
        publishers = {ts: WeightPublisher(addrs, secret=self.spec.secret) for ts, addrs in self.spec.routes.items()}
        checkpoint_every = max((self.ctx.node(n).attrs.get("checkpoint_every", 0) for n in self.group.nodes
                                if self.ctx.node(n).op == "train_step"), default=0)
        (out / "trajectories").mkdir(parents=True, exist_ok=True)
        try:
            with (out / "trajectories" / "trajectories.jsonl").open("w") as log:
                for step in range(topo.steps):
                    waited = time.perf_counter()
                    while not buffer.ready(step):
                        item = self._receive(timeout_s=1.0)
                        if item is None:
                            if time.perf_counter() - waited > self.spec.recv_timeout_s:
                                raise TimeoutError(f"trainer step {step}: no experience for "
                                                   f"{self.spec.recv_timeout_s} s")
                            continue
                        self.control.send(("received", item.index, item.attempt))
                        file_group(item, items, buffer, self.counts, self.ctx.plan)
                    wait_s = time.perf_counter() - waited
                    started = time.perf_counter()
                    buffer.take_batch(step)
                    batch_items = [items.pop(i) for i in range(step * topo.batch_groups, (step + 1) * topo.batch_groups)]
                    checkpoint = bool(checkpoint_every) and (step + 1) % checkpoint_every == 0
                    with self.lease:  # a mesh time-shared with generation: one of them at a time
                        stats, advantage = self._batch_step(step, batch_items, publish=step + 1 < topo.steps,
                                                            checkpoint=checkpoint, publishers=publishers)
                    train_s = time.perf_counter() - started
                    self.counts["groups"] += len(batch_items)
                    for t in advantage["trajectories"]:
                        log.write(json.dumps({**asdict(t), "step": step, "staleness": t.staleness(step)}) + "\n")
                    log.flush()
                    metrics = step_metrics(step, stats, advantage["batch"], advantage["trajectories"], train_s, wait_s)
                    if checkpoint:
                        metrics["checkpoint"] = str(out / "checkpoints" / f"version_{step + 1}")
                    every = int(self.ctx.plan.run.get("eval", {}).get("every", 0) or 0)
                    if every and (step + 1) % every == 0 and step + 1 < topo.steps:
                        metrics["eval/accuracy"] = self._held_out_accuracy()
                    if self.ctx.plan.run.get("debug", {}).get("memory_profiler"):
                        memory_profile(step, out / "memory.jsonl", [self.executors[n.name] for n in self.batch_nodes
                                                                    if n.op == "train_step"],
                                       cuda=self.ctx.plan.device_type == "cuda")
                    if self.report is not None:
                        self.report(metrics)
            self._save_final(out / "model")
        finally:
            for p in publishers.values():
                p.close()
        return {**self.counts, "steps": topo.steps, "consumed": len(buffer.consumed_ids),
                "world_size": self.group.strategy.world_size, "rejected_messages": self.inbox.rejected,
                **failure_counts(self.executors)}

    def _held_out_accuracy(self) -> float:
        """Greedy accuracy of the current policy on the run's held-out problems (``eval.n_test``),
        measured in this worker between steps (``eval.every``)."""
        from areal_flow.ops.dataset import build_task
        from runtime.engines.evaluate import answer_accuracy, greedy_answers
        from runtime.model_source import load_pretrained

        plan = self.ctx.plan
        if self._eval is None:
            task = build_task(self.topo.dataset.attrs, plan.run["seed"])
            self._eval = (task, task.test_set(plan.run["eval"]["n_test"]))
        task, problems = self._eval
        node = next(n for n in self.batch_nodes if n.op == "train_step" and n.model == self.ctx.policy_name())
        executor = self.executors[node.name]
        model, _ = load_pretrained(executor.settings.model_folder)
        model.load_state_dict(executor.current_state())
        gen = self.ctx.generator()
        if gen.op == "rollout":
            from runtime.engines.evaluate import evaluate_episodes
            from runtime.executors.rollout import model_context

            limit = gen.attrs.get("max_context") or model_context(executor.settings.model_folder)
            return evaluate_episodes(model, self.ctx.tokenizer, gen.attrs, problems, max_context=int(limit),
                                     temperature=float(plan.run["eval"].get("temperature", 0.0)))["accuracy"]
        answers = greedy_answers(model, self.ctx.tokenizer, task, problems,
                                 chat_template=self.topo.generate.attrs.get("chat_template"))
        return answer_accuracy(task, answers, problems)

    def _batch_step(self, step: int, batch_items: list[GroupItem], *, publish: bool, checkpoint: bool,
                    publishers: dict) -> tuple[dict, dict]:
        values: dict = {}
        stats: dict = {}
        advantage = None
        for node in self.batch_nodes:
            inputs = {}
            for port, (src, src_port) in node.inputs.items():
                key = f"{src}.{src_port}"
                inputs[port] = values[key] if key in values else [it.values[key] for it in batch_items]
            is_step = node.op == "train_step"
            info = {"step": step, "publish": is_step and (publish and node.name in publishers or checkpoint)}
            result = self.executors[node.name].run(inputs, info)
            values.update({f"{node.name}.{port}": v for port, v in result.items()})
            if is_step:
                stats.update(result["stats"])
                advantage = inputs["advantages"]
                if publish and node.name in publishers:
                    publisher, sent, started = publishers[node.name], publishers[node.name].published_bytes, \
                        time.perf_counter()
                    publisher.publish(result["weights"], step + 1)
                    self.version = step + 1
                    stats["weights/sync_s"] = time.perf_counter() - started
                    stats["weights/bytes"] = float(publisher.published_bytes - sent)
                if "lr" in node.attrs and node.model == self.ctx.policy_name():
                    stats["lr"] = float(node.attrs["lr"])
                if checkpoint:
                    self._save_one(node, Path(self.spec.out_dir) / "checkpoints" / f"version_{step + 1}",
                                   result["weights"])
        return stats, advantage

    def _save_one(self, node, folder: Path, state) -> None:
        name = folder if node.model == self.ctx.policy_name() else folder / node.model
        self.executors[node.name].save(name, state)

    def _save_final(self, folder: Path) -> None:
        for node in self.batch_nodes:
            if node.op == "train_step":
                ex = self.executors[node.name]
                path = folder if node.model == self.ctx.policy_name() else folder.parent / node.model
                ex.save(path, ex.final_state())
