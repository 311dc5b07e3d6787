"""Cost of one device node under one strategy on a mesh of a given size.

Owns :class:`CostModel`: the valid strategies of a node for a mesh size, its memory per
device (choosing micro-batches or KV-cache slots that fit) and its predicted seconds per
step, memoized. Memory is sized for the budget (every response at ``max_new_tokens``: a
KV slot and a micro-batch must hold the longest one); time for the expected lengths
(``compiler.lengths``): training over ``n * (P + E[L])`` tokens, generation by
``compiler.timing.generation_time``. Costs depend on the mesh only through its size: meshes larger than a
machine are whole machines, so whether a group crosses the network follows from sizes.
It must not choose placements (``compiler.search`` does).

Micro-batches ``m`` (powers of two, at least one sequence each) are chosen for time among
those that fit: the pipeline bubble falls as ``1/m`` while collective latencies and FSDP
traffic grow with ``m`` (``compiler.timing``). Under FSDP every term is ``a/m``, ``b m``
or a convex, growing function of ``b m`` (the exposed traffic), so the time is convex in
``log2 m`` and the scan stops at the first ``m`` whose double is no faster.

A critic's train_step on several ranks (``runtime.parallel_critic``) costs what a trainer
under its strategy costs, plus what rank 0 adds: a whole fp32 copy of the critic
(:data:`WHOLE_COPY_BYTES` per parameter, in ``weights``) and, every step, the gather of the
shards into it (``gather``: a ring all-gather of that copy over the mesh,
``compiler.timing.ring_gather_s``).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, replace

from areal_flow.config_compile import ClusterConfig, CompileConfig
from compiler.hardware import DeviceSpec
from compiler.decode import DecodeCost
from compiler.executable import NodeFacts, check_node, failed_rule
from compiler.lengths import LengthDist
from compiler.memory import (
    MemoryBreakdown,
    generation_memory,
    inference_memory,
    kv_bytes_per_sequence,
    training_memory,
)
from compiler.mesh import aligned_sizes
from compiler.strategy import ParallelStrategy, StrategyError
from compiler.timing import (
    Links, compute_s, generation_time, ring_gather_s, swap_time, training_time, weight_sync_time, received_bytes,
)
from compiler.workload import GENERATION, TRAINING, DeviceTask, Workload


WHOLE_COPY_BYTES = 4
"""Bytes per parameter of rank 0's whole copy of a critic trained on several ranks: fp32, the
master weights ``model.dtype``'s autocast runs over (``runtime.executors.train`` keeps it for the
advantage node's values; ``runtime.parallel_critic.RankCritic.gather_into`` fills it)."""


@dataclass(frozen=True)
class NodeCost:
    """One node's cost under one strategy.

    Attributes:
        strategy: the parallel strategy.
        memory: bytes per device by component.
        fits: memory.total <= the usable device memory.
        times: seconds per step by component (``swap`` when the mesh is time-shared).
        micro_batches: training/inference micro-batches per DP rank (None for generation).
        concurrent: sequences a generation replica decodes at once (None otherwise).
    """

    strategy: ParallelStrategy
    memory: MemoryBreakdown
    fits: bool
    times: dict
    micro_batches: int | None = None
    concurrent: int | None = None

    @property
    def time_s(self) -> float:
        return sum(self.times.values())


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


class CostModel:
    """Memoized per-node costs for one workload, device kind, cluster and config; ``scheduler``
    is the runtime the plan is for (``scheduler.type``: ``local`` or ``ray``, whose placements
    must also pass ``compiler.hosting.ray_hosting_problem``); ``micro_batch_rows``: sequences a
    training micro-batch holds (``train.micro_batch_size``) when ``compile.micro_batches`` is
    null, so each strategy's count per DP rank follows its ``dp``; ``sync_dtype``: the dtype the
    weights travel in to the generators (``bf16``/``fp16``/``fp32``, the plan's ``weights_dtype``
    where it names one), None: ``compile.dtype``."""

    def __init__(self, workload: Workload, device: DeviceSpec, cluster: ClusterConfig, cfg: CompileConfig,
                 scheduler: str = "local", micro_batch_rows: int | None = None, sync_dtype: str | None = None):
        self.workload = workload
        self.sync_dtype = sync_dtype or cfg.dtype
        self.micro_batch_rows = micro_batch_rows
        self.scheduler = scheduler
        self.device = device
        self.cluster = cluster
        self.cfg = cfg
        self.per_node = cluster.n_gpus_per_node
        self.total_devices = cluster.n_nodes * cluster.n_gpus_per_node
        self.usable = device.memory_bytes * cfg.memory_fraction
        self.checkpointing = cfg.activation_checkpointing is not False  # on or auto: train_steps may recompute
        self.links = Links(device, cluster.n_gpus_per_node, cfg.bandwidth_efficiency)
        self.lengths = LengthDist(cfg.length_dist, workload.new_tokens)
        self._costs: dict = {}
        self._strategies: dict = {}
        self._schedules: dict = {}  # drain schedules by (responses per replica, slots)

    # -- strategies -----------------------------------------------------------------
    def check(self, task: DeviceTask, s: ParallelStrategy, size: int) -> None:
        """Raise StrategyError (naming the node) if ``s`` cannot run ``task`` on ``size`` devices, or
        ``compiler.executable.ExecutableError`` (naming the node and the rule) if the runtime cannot run it."""
        m = task.model
        try:
            if s.world_size != size:
                raise StrategyError(f"world size dp*tp*pp*cp={s.world_size} != mesh size {size}")
            s.validate_for(
                n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
                n_experts=m.n_experts, gpus_per_node=self.per_node, replicate_kv=task.role == GENERATION,
            )
            if task.role == GENERATION and s.cp > 1:
                raise StrategyError("cp > 1 is not supported for generation (decode is one token at a time)")
        except StrategyError as err:
            raise StrategyError(f"node '{task.node}' ({task.model.name}), strategy {s.short()}: {err}") from None
        check_node(self.facts(task, s))

    def facts(self, task: DeviceTask, s: ParallelStrategy) -> NodeFacts:
        """What ``compiler.executable``'s rules read of ``task`` under ``s``."""
        m = task.model
        shape = dict(n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, n_experts=m.n_experts)
        return NodeFacts.from_attrs(task.node, task.role, s, self.workload.node_attrs.get(task.node, {}), shape=shape,
                                    critic=task.critic,
                                    rows=self.workload.step_rows or self.workload.n_sequences)

    def strategies(self, task: DeviceTask, size: int) -> list[ParallelStrategy]:
        """The search space of ``task`` on ``size`` devices: every valid strategy with

        - ``dp`` at most the step's sequences (a rank or replica without one idles);
        - ``cp`` a power of two with ``tp * cp`` within one machine (ring attention passes
          K/V every layer, so CP ranks sit next to TP ranks on NVLink, Megatron's order
          tp-cp-dp-pp), training side only (decode is one token at a time);
        - ``ep`` a divisor of the experts and of ``dp * cp`` up to the machine size (the
          all-to-all of every MoE layer stays on NVLink, as slime's ep8 and verl's ep4 runs of
          Qwen3-30B-A3B do), training side of a MoE model only;
        - and that the runtime can run (``compiler.executable``'s rules: a critic's train_step
          within ``CRITIC_PARALLEL`` and ``CRITIC_APART``). That a multi-rank critic on the
          policy train_step's mesh takes its strategy (``compiler.hosting``'s ``critic-ranks``,
          e.g. ``train:t2 | critic_step:t2``) is the search's to keep (``compiler.choose``).
        """
        key = (task.node, size)
        if key not in self._strategies:
            m, train_side = task.model, task.role != GENERATION
            found = []
            for tp in range(1, min(size, self.per_node) + 1):
                kv_ok = m.n_kv_heads % tp == 0 or (not train_side and tp % m.n_kv_heads == 0)
                if size % tp or m.n_heads % tp or not kv_ok:
                    continue
                for pp in range(1, m.n_layers + 1):
                    if m.n_layers % pp or (size // tp) % pp:
                        continue
                    rest = size // (tp * pp)
                    cp = 1
                    while cp <= (self.per_node // tp if train_side else 1) and rest % cp == 0:
                        dp = rest // cp
                        if dp <= self.workload.n_sequences:
                            eps = [e for e in range(1, min(m.n_experts, self.per_node) + 1)
                                   if m.n_experts % e == 0 and dp * cp % e == 0]
                            for ep in eps if train_side and m.is_moe else [1]:
                                s = ParallelStrategy(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
                                if failed_rule(self.facts(task, s)) is None:
                                    found.append(s)
                        cp *= 2
            self._strategies[key] = found
        return self._strategies[key]

    def trained_seq_len(self, task: DeviceTask, s: ParallelStrategy) -> float:
        """Tokens a training-side ``task`` computes per sequence on average under ``s``: the prompt
        budget plus the mean response; a node that runs a group's prompt once
        (``Workload.shared_prompt_nodes``) counts ``prompt_len / samples_per_prompt`` of it, except
        under pp or cp, whose runners train padded rows (``runtime.parallel.rl_runner.right_padded``)."""
        w = self.workload
        shared = task.node in w.shared_prompt_nodes and s.pp == 1 and s.cp == 1
        return (w.prompt_len / w.samples_per_prompt if shared else w.prompt_len) + self.lengths.mean

    def time_floor(self, task: DeviceTask, s: ParallelStrategy) -> float:
        """A lower bound on the seconds of training-side ``task`` under ``s`` at any
        micro-batch count: its time at ``m = 1`` less the pipeline bubble (every other term
        is a constant plus a part that grows with ``m``: collective latencies per
        micro-batch, FSDP traffic per micro-batch and the share of it left exposed)."""
        key = ("floor", task.node, s)
        if key not in self._costs:
            w, cfg = self.workload, self.cfg
            times = training_time(
                task.model, s, n_sequences=w.n_sequences, seq_len=self.trained_seq_len(task, s), micro_batches=1,
                dtype=cfg.dtype, sharded=cfg.optimizer_sharding, checkpointing=self.checkpointing,
                forward_only=task.role != TRAINING, mfu=cfg.mfu, links=self.links, mesh_spans_nodes=self._spans(s),
                overlap=cfg.fsdp_overlap,
            )
            self._costs[key] = sum(times.values()) - times["bubble"] + self._gather_s(task, s)
        return self._costs[key]

    def generation_floor(self, task: DeviceTask, s: ParallelStrategy) -> float:
        """A lower bound on generation ``task``'s seconds under ``s`` whatever its KV slots:
        with ``k >= 1`` its closed form at one slot per response (a step's seconds per live
        response fall as the batch grows); with ``k = 0`` the prefills plus the longest
        response decoded alone (a step never costs less than at batch 1 with that response's
        own context) or, if larger, every token at the per-token price of a step with all
        responses live and only their prompts as context; no continuous-batch drain."""
        key = ("generation_floor", task.node, s.tp, s.pp, s.dp)
        if key not in self._costs:
            w, cfg = self.workload, self.cfg
            per_replica = -(-w.n_sequences // s.dp)
            if w.staleness >= 1:  # a step's cost per response falls with the live batch: best at c = per_replica
                self._costs[key] = sum(generation_time(
                    task.model, s, n_sequences=w.n_sequences, prompt_len=w.prompt_len, lengths=self.lengths,
                    concurrent=per_replica, refill=True, dtype=cfg.dtype, mfu=cfg.mfu, links=self.links,
                    overhead_s=cfg.decode_step_overhead_s, samples_per_prompt=w.samples_per_prompt).values())
            else:
                cost = DecodeCost.build(task.model, s, dtype=cfg.dtype, mfu=cfg.mfu, links=self.links,
                                        overhead_s=cfg.decode_step_overhead_s, prompt_len=w.prompt_len,
                                        samples_per_prompt=w.samples_per_prompt)
                lengths = self.lengths.quantiles(per_replica)
                alone = cost.run_s(1, w.prompt_len, max(lengths))
                # every token at the cheapest per-token price: all responses live, prompts only as context
                work = sum(lengths) * cost.step_s(per_replica, per_replica * w.prompt_len) / per_replica
                self._costs[key] = cost.prefill_s(per_replica) + max(alone, work)
        return self._costs[key]

    def can_fit(self, task: DeviceTask, s: ParallelStrategy) -> bool:
        """Whether training-side ``task`` fits under ``s`` at some micro-batch count: its memory
        at the most micro-batches (or ``compile.micro_batches``) fits, as memory never grows
        with ``m``; equals ``cost(task, s, ...).fits`` at a fraction of the work."""
        key = ("can_fit", task.node, s)
        if key not in self._costs:
            w, cfg = self.workload, self.cfg
            m = self._configured_micro_batches(s) or self._most_micro_batches(s)
            kw = dict(tokens_per_step=w.n_sequences * w.seq_len, micro_batches=m, dtype=cfg.dtype,
                      sharded=cfg.optimizer_sharding)
            mem = (training_memory(task.model, s, checkpointing=self.checkpointing, **kw)
                   if task.role == TRAINING else inference_memory(task.model, s, **kw))
            self._costs[key] = mem.total + self._whole_copy(task, s) <= self.usable
        return self._costs[key]

    def compute_floor(self, task: DeviceTask, size: int) -> float:
        """A lower bound on a training-side node's seconds on ``size`` devices under any
        strategy: its FLOPs at the assumed MFU (``compiler.timing.compute_s``; the shortest trained
        sequence, a strategy without pp and cp's)."""
        w, cfg = self.workload, self.cfg
        return compute_s(task.model, size, n_sequences=w.n_sequences, seq_len=self.trained_seq_len(task, ParallelStrategy()),
                         checkpointing=self.checkpointing, forward_only=task.role != TRAINING,
                         mfu=cfg.mfu, peak_flops=self.device.peak_flops)

    def _configured_micro_batches(self, s: ParallelStrategy) -> int | None:
        """Micro-batches per DP rank the config fixes under ``s``: ``compile.micro_batches``, else
        from ``micro_batch_rows`` (``train.micro_batch_size``, sequences per micro-batch): the
        rank's ``n_sequences / dp`` rows in micro-batches of at most that many, ``ceil(n / dp /
        rows)``; None: the compiler chooses."""
        if self.cfg.micro_batches is not None:
            return self.cfg.micro_batches
        if self.micro_batch_rows:
            return max(1, math.ceil(self.workload.n_sequences / s.dp / self.micro_batch_rows))
        return None

    def _most_micro_batches(self, s: ParallelStrategy) -> int:
        """Most micro-batches per DP rank: each holds at least one sequence (a power of two)."""
        return _pow2_floor(self.workload.n_sequences // s.dp)

    # -- costs ----------------------------------------------------------------------
    def cost(self, task: DeviceTask, s: ParallelStrategy, shared: bool) -> NodeCost:
        """Cost of ``task`` under ``s`` on a mesh of ``s.world_size`` devices, time-shared
        with other nodes when ``shared`` (then it pays an offload/reload swap)."""
        key = (task.node, s, shared)
        cost = self._costs.get(key)
        if cost is None:
            cost = self._generation(task, s) if task.role == GENERATION else self._training(task, s)
            if shared:
                mem = cost.memory
                resident = mem.weights + mem.gradients + mem.optimizer
                cost = NodeCost(
                    cost.strategy, mem, cost.fits, {**cost.times, "swap": swap_time(resident, self.links)},
                    cost.micro_batches, cost.concurrent,
                )
            self._costs[key] = cost
        return cost

    def _spans(self, s: ParallelStrategy) -> bool:
        return s.world_size > self.per_node

    def _whole_copy(self, task: DeviceTask, s: ParallelStrategy) -> float:
        """Bytes of rank 0's whole copy of a critic trained on several ranks, else 0 (module doc)."""
        return WHOLE_COPY_BYTES * task.model.n_params if task.critic and s.world_size > 1 else 0.0

    def _gather_s(self, task: DeviceTask, s: ParallelStrategy) -> float:
        """Seconds a step of a multi-rank critic spends gathering its shards into rank 0's whole copy
        (a ring all-gather of it over the mesh's link), else 0 (module doc)."""
        whole, span = self._whole_copy(task, s), s.world_size
        if not whole:
            return 0.0
        return ring_gather_s(whole, span, self.links.group_bw(span, self._spans(s)), self.links.latency)

    def _training(self, task: DeviceTask, s: ParallelStrategy, micro_batches: int | None = None) -> NodeCost:
        w, cfg = self.workload, self.cfg
        tokens = w.n_sequences * w.seq_len
        forward_only = task.role != TRAINING

        def memory(m: int) -> MemoryBreakdown:
            if forward_only:
                return inference_memory(
                    task.model, s, tokens_per_step=tokens, micro_batches=m, dtype=cfg.dtype,
                    sharded=cfg.optimizer_sharding,
                )
            mem = training_memory(
                task.model, s, tokens_per_step=tokens, micro_batches=m, dtype=cfg.dtype,
                sharded=cfg.optimizer_sharding, checkpointing=self.checkpointing,
            )
            return replace(mem, weights=mem.weights + whole) if whole else mem

        def time(m: int) -> dict:
            times = training_time(
                task.model, s, n_sequences=w.n_sequences, seq_len=self.trained_seq_len(task, s), micro_batches=m,
                dtype=cfg.dtype, sharded=cfg.optimizer_sharding, checkpointing=self.checkpointing,
                forward_only=forward_only, mfu=cfg.mfu, links=self.links, mesh_spans_nodes=self._spans(s),
                overlap=cfg.fsdp_overlap,
            )
            return {**times, "gather": gather} if whole else times

        whole, gather = self._whole_copy(task, s), self._gather_s(task, s)
        m = micro_batches or self._configured_micro_batches(s)
        if m is None:  # the fastest power of two that fits; the fewest when none fits (for the error)
            most = self._most_micro_batches(s)
            m = 1 if memory(most).total <= self.usable else most  # the fewest that fit, else most
            while m < most and memory(m).total > self.usable:  # memory never grows with m
                m *= 2
            times = time(m)
            best = sum(times.values())
            more = 2 * m
            while more <= most:
                t = time(more)
                if sum(t.values()) < best:
                    m, times, best = more, t, sum(t.values())
                elif cfg.optimizer_sharding:
                    break  # convex in log2 m under FSDP (module docstring): no later m is faster
                more *= 2
        else:
            times = time(m)
        mem = memory(m)
        return NodeCost(s, mem, mem.total <= self.usable, times, micro_batches=m)

    def _generation(self, task: DeviceTask, s: ParallelStrategy, concurrent: int | None = None) -> NodeCost:
        key = ("generation", task.node, s, concurrent)
        if key not in self._costs:
            self._costs[key] = self._generation_uncached(task, s, concurrent)
        return self._costs[key]

    def _generation_uncached(self, task: DeviceTask, s: ParallelStrategy, concurrent: int | None) -> NodeCost:
        w, cfg = self.workload, self.cfg
        per_replica = -(-w.n_sequences // s.dp)
        if concurrent is None:
            weights = generation_memory(task.model, s, concurrent=0, seq_len=w.seq_len, dtype=cfg.dtype).weights
            per_seq = kv_bytes_per_sequence(task.model, s, w.seq_len, cfg.dtype)
            concurrent = max(1, min(per_replica, int((self.usable - weights) // per_seq)))
        mem = generation_memory(task.model, s, concurrent=concurrent, seq_len=w.seq_len, dtype=cfg.dtype)
        # a replica's seconds depend on its shape (tp, pp), its share of the step and its slots only
        key = ("replica", task.node, s.tp, s.pp, per_replica, concurrent)
        if key not in self._costs:
            self._costs[key] = generation_time(
                task.model, s, n_sequences=w.n_sequences, prompt_len=w.prompt_len, lengths=self.lengths,
                concurrent=concurrent, refill=w.staleness >= 1, dtype=cfg.dtype, mfu=cfg.mfu, links=self.links,
                overhead_s=cfg.decode_step_overhead_s, schedules=self._schedules,
                samples_per_prompt=w.samples_per_prompt,
            )
        return NodeCost(s, mem, mem.total <= self.usable, dict(self._costs[key]), concurrent=concurrent)

    def floor(self, task: DeviceTask) -> NodeCost:
        """The smallest memory per device ``task`` can reach on any aligned mesh of this
        cluster: most micro-batches (training) or one KV slot (generation)."""
        best = None
        for size in aligned_sizes(self.cluster.n_nodes, self.per_node):
            for s in self.strategies(task, size):
                if task.role == GENERATION:
                    cost = self._generation(task, s, concurrent=1)
                else:
                    cost = self._training(task, s, micro_batches=self._most_micro_batches(s))
                if best is None or cost.memory.total < best.memory.total:
                    best = cost
        return best

    def sync_floor(self, train: DeviceTask, gen_strategy: ParallelStrategy, same_machine: bool) -> float:
        """A lower bound on :meth:`sync` over every training mesh: the seconds for each
        generation device to receive its shard (the trainers' sends left out)."""
        receive = received_bytes(train.model, gen_strategy, self.sync_dtype)
        return self.links.latency + receive / (self.links.intra if same_machine else self.links.inter)

    def sync(self, train: DeviceTask, gen_strategy: ParallelStrategy, train_devices: int, same_machine: bool):
        """``(seconds, bytes, link)`` of the weight sync from ``train`` into ``gen_strategy``."""
        return weight_sync_time(
            train.model, gen_strategy, train_devices=train_devices, dtype=self.sync_dtype,
            same_machine=same_machine, links=self.links,
        )
