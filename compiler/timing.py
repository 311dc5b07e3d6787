"""Predicted seconds of training, forward-only inference, generation and weight sync.

Formulas and sources:

- FLOPs per token (Kaplan et al. 2020, "Scaling Laws for Neural Language Models",
  Table 1): forward ``2N + 2 * L * n_ctx * d_attn`` (``N`` active parameters, ``d_attn`` =
  heads x head dim); training = 3x forward; full activation recomputation adds one
  forward (4x, Korthikanti et al. 2022, section 4). Time = FLOPs / (devices x peak x MFU).
  The RL trainer keeps routed experts whole on every TP rank (no expert TP), so each TP
  rank runs its tokens' routed-expert FLOPs itself: ``(tp - 1)`` more copies of them.
- Pipeline bubble (Huang et al. 2019, GPipe; Narayanan et al. 2021, eq. 1): a fraction
  ``(p-1)/(m+p-1)`` of the step is idle, i.e. busy time x ``(m+p-1)/m``.
- Tensor parallelism (Shoeybi et al. 2019, Megatron-LM, section 3): 2 all-reduces of the
  micro-batch's ``tokens x h`` activations per layer forward, 2 backward (+2 when a layer
  is recomputed). Ring all-reduce moves ``2(n-1)/n`` x bytes per device; all-gather and
  reduce-scatter ``(n-1)/n`` (Thakur et al. 2005, ring algorithms).
- Data parallelism: dense gradients (``/ (tp * pp)`` per device) over the ``dp * cp`` ranks,
  routed experts' (``/ (pp * ep)``: whole on each TP rank) over the ``dp * cp / ep`` ranks
  that hold the same experts. Without sharding (DDP), one all-reduce
  of the gradients per step (gradient accumulation skips it on all but the last
  micro-batch). With ZeRO-3/FSDP, per micro-batch two all-gathers of the weights (forward,
  and backward, which also serves the recomputation) and one reduce-scatter of the
  gradients, 1.5x the all-reduce volume (Rajbhandari et al. 2020, section 7.2; PyTorch FSDP
  reshards after forward and reduce-scatters every backward, Zhao et al. 2023, section 3).
- Overlap (ASSUMED, ``compile.fsdp_overlap`` = w): prefetching hides a fraction w of the
  DP traffic behind compute, up to the compute it can hide behind: FSDP traffic behind the
  whole step's compute, DDP's all-reduce behind the last micro-batch's backward (2/3 of its
  compute). Exposed seconds = traffic - w * min(traffic, that compute).
- Context parallelism (ring attention, Liu et al. 2023): each layer passes the K/V shard
  ``cp-1`` times forward and twice as much backward. Expert parallelism: two all-to-alls
  (dispatch, combine) of ``k`` routed copies per MoE layer forward, two backward (their
  gradients), two more when the layer is recomputed; ``(ep-1)/ep`` of the copies leave
  the device (Lepikhin et al. 2020, GShard, section 2.2).
- Generation: response lengths follow ``compile.length_dist`` (``compiler.lengths``); a
  replica decodes as many responses at once as its KV cache holds with continuous
  batching (no waves), each step costing ``compiler.decode.DecodeCost`` (weights and live
  KV cache read once per step, Pope et al. 2022). With ``k >= 1`` freed slots are refilled
  (throughput); with ``k = 0`` the batch drains and the step waits for its longest response.
- Weight sync: every generation device receives its shard of the 16-bit weights; the
  training devices send ``dp_gen`` full copies between them; time = the larger per-device
  volume over the slowest link crossed (NVLink inside one machine, else the network).
"""

from __future__ import annotations

import math

from compiler.decode import DecodeCost, DrainSchedule, drain_s
from compiler.hardware import DeviceSpec
from compiler.lengths import LengthDist
from compiler.memory import DTYPE_BYTES, micro_batch_tokens, params_per_device
from compiler.models import ModelSpec
from compiler.strategy import ParallelStrategy


def ring_all_reduce_s(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``n`` devices (0 when n == 1)."""
    return 0.0 if n <= 1 else latency + 2 * (n - 1) / n * nbytes / bandwidth


def ring_gather_s(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-gather or reduce-scatter whose full result is ``nbytes``."""
    return 0.0 if n <= 1 else latency + (n - 1) / n * nbytes / bandwidth


class Links:
    """Achieved bandwidths of one device kind and which link a process group crosses."""

    def __init__(self, device: DeviceSpec, devices_per_node: int, efficiency: float):
        self.device = device
        self.per_node = devices_per_node
        self.intra = device.intra_node_bandwidth * efficiency
        self.inter = device.inter_node_bandwidth * efficiency
        self.hbm = device.hbm_bandwidth * efficiency
        self.host = device.host_bandwidth * efficiency
        self.latency = device.collective_latency_s

    def group_bw(self, span: int, mesh_spans_nodes: bool) -> float:
        """Bandwidth of a group whose ranks cover ``span`` consecutive devices of a mesh."""
        return self.inter if mesh_spans_nodes and span > self.per_node else self.intra


def train_flops_per_token(model: ModelSpec, seq_len: int, checkpointing: bool) -> float:
    """Hardware FLOPs per trained token: 3 (or 4 with recomputation) forwards."""
    forward = 2 * model.n_active_params + 2 * model.n_layers * seq_len * model.n_heads * model.head_dim
    return forward * (4 if checkpointing else 3)


def compute_s(model: ModelSpec, devices: int, *, n_sequences: int, seq_len: float, checkpointing: bool,
              forward_only: bool, mfu: float, peak_flops: float) -> float:
    """Seconds of the matmul FLOPs of a train_step (or forward-only pass) over ``n_sequences``
    of ``seq_len`` tokens spread over ``devices`` at ``mfu`` of ``peak_flops``: a lower bound
    on :func:`training_time` (its other terms are >= 0)."""
    per_token = train_flops_per_token(model, seq_len, checkpointing and not forward_only)
    flops = n_sequences * seq_len * (per_token / 3 if forward_only else per_token)
    return flops / (devices * peak_flops * mfu)


def training_time(
    model: ModelSpec,
    s: ParallelStrategy,
    *,
    n_sequences: int,
    seq_len: int,
    micro_batches: int,
    dtype: str,
    sharded: bool,
    checkpointing: bool,
    forward_only: bool,
    mfu: float,
    links: Links,
    mesh_spans_nodes: bool,
    overlap: float = 0.0,
) -> dict[str, float]:
    """Seconds of one train_step (or forward-only pass) over ``n_sequences`` of ``seq_len``.

    Args:
        micro_batches: ``m`` per DP rank; FSDP traffic and every per-layer collective's
            latency grow with it, the pipeline bubble shrinks with it.
        overlap: fraction ``w`` in [0, 1] of the DP traffic hidden behind compute (see the
            module docstring); 0 = none.

    Returns:
        ``{"compute", "tp_comm", "cp_comm", "ep_comm", "bubble", "dp_comm"}`` seconds.
    """
    b = DTYPE_BYTES[dtype]
    tokens = n_sequences * seq_len
    m = micro_batches
    passes = 1 if forward_only else (4 if checkpointing else 3)  # forward, backward (x2 cost), recompute
    compute = compute_s(model, s.world_size, n_sequences=n_sequences, seq_len=seq_len, checkpointing=checkpointing,
                        forward_only=forward_only, mfu=mfu, peak_flops=links.device.peak_flops)
    if model.is_moe and s.tp > 1:  # the trainer keeps experts whole on each TP rank: their FLOPs are not split by tp
        routed = model.n_layers * model.experts_per_token * 3 * model.hidden * model.expert_intermediate
        compute += (s.tp - 1) * tokens * 2 * routed * passes / (s.world_size * links.device.peak_flops * mfu)
    t_mb = micro_batch_tokens(tokens, s, m)
    layers = model.n_layers // s.pp
    tp_calls = m * layers * (2 if forward_only else (6 if checkpointing else 4))
    tp_comm = tp_calls * ring_all_reduce_s(t_mb * model.hidden * b, s.tp, links.intra, links.latency)
    kv_shard = t_mb * 2 * model.n_kv_heads * model.head_dim * b
    cp_bw = links.group_bw(s.tp * s.cp, mesh_spans_nodes)
    cp_comm = 0.0 if s.cp == 1 else m * layers * passes * (s.cp - 1) * (links.latency + kv_shard / cp_bw)
    ep_comm = 0.0
    if s.ep > 1:
        routed = t_mb * model.experts_per_token * model.hidden * b
        ep_bw = links.group_bw(s.tp * s.ep, mesh_spans_nodes)
        rounds = 1 if forward_only else (3 if checkpointing else 2)  # forward, backward, recompute
        ep_comm = m * layers * 2 * rounds * ((s.ep - 1) / s.ep * routed / ep_bw + links.latency)
    busy = compute + tp_comm + cp_comm + ep_comm
    bubble = busy * (s.pp - 1) / m
    dp_n = s.dp * s.cp
    dp_comm = 0.0
    if not forward_only and dp_n > 1:
        expert_bytes = b * model.n_expert_params / (s.pp * s.ep)  # whole on each TP rank
        dense_bytes = b * (model.n_params - model.n_expert_params) / (s.tp * s.pp)
        groups = ((dense_bytes, dp_n), (expert_bytes, dp_n // s.ep))
        dp_bw = links.group_bw(s.tp * dp_n, mesh_spans_nodes)
        for grad_bytes, ranks in groups:  # dense grads over dp*cp ranks, expert grads over dp*cp/ep
            if grad_bytes == 0:
                continue
            if sharded:
                dp_comm += m * 3 * ring_gather_s(grad_bytes, ranks, dp_bw, links.latency)
            else:
                dp_comm += ring_all_reduce_s(grad_bytes, ranks, dp_bw, links.latency)
        hideable = compute if sharded else compute / m * 2 / 3
        dp_comm -= overlap * min(dp_comm, hideable)
    return dict(compute=compute, tp_comm=tp_comm, cp_comm=cp_comm, ep_comm=ep_comm, bubble=bubble, dp_comm=dp_comm)


def generation_time(
    model: ModelSpec,
    s: ParallelStrategy,
    *,
    n_sequences: int,
    prompt_len: int,
    lengths: LengthDist,
    concurrent: int,
    refill: bool,
    dtype: str,
    mfu: float,
    links: Links,
    overhead_s: float,
    schedules: dict | None = None,
    samples_per_prompt: int = 1,
) -> dict[str, float]:
    """Seconds for ``s.dp`` replicas of ``tp * pp`` to generate one step's ``n_sequences``
    responses, whose lengths follow ``lengths`` (``compiler.decode`` gives the step cost).

    Args:
        concurrent: responses one replica decodes at once (KV-cache slots), >= 1.
        refill: True when freed slots are refilled from the next step's prompts (async,
            ``k >= 1``): the replica runs full, at ``c`` live responses whose context is
            ``P + E[L(L-1)/2] / E[L]`` on average (``LengthDist.mean_age``), for
            ``ceil(n / dp) * E[L] / c`` steps. False (``k = 0``): the replica's share is a
            batch that drains: :func:`compiler.decode.drain_s` over its expected sample of
            lengths (mid-quantiles), so the step waits for the longest response while the
            live batch shrinks.
        schedules: a memo of :class:`compiler.decode.DrainSchedule` by ``(responses per
            replica, slots)`` that the caller keeps across calls (a drain's schedule does
            not depend on the replica's shape); None: build it each call.
        samples_per_prompt: responses sharing one prompt, prefilled once (``DecodeCost``).

    Returns:
        ``{"prefill", "decode"}`` seconds.
    """
    per_replica = math.ceil(n_sequences / s.dp)
    c = max(1, min(concurrent, per_replica))
    cost = DecodeCost.build(model, s, dtype=dtype, mfu=mfu, links=links, overhead_s=overhead_s, prompt_len=prompt_len,
                            samples_per_prompt=samples_per_prompt)
    prefill = cost.prefill_s(per_replica)
    if refill:
        steps = per_replica * lengths.mean / c
        decode = steps * cost.step_s(c, c * (prompt_len + lengths.mean_age))
    else:
        sample = lengths.quantiles(per_replica)
        schedule = None if schedules is None else schedules.get((per_replica, c))
        if schedules is not None and schedule is None:
            schedule = schedules[per_replica, c] = DrainSchedule.of(sample, c)
        decode = drain_s(cost, sample, c, schedule) - prefill
    return dict(prefill=prefill, decode=decode)


def wire_bytes(model: ModelSpec, dtype: str) -> float:
    """Bytes of one copy of ``model``'s weights on the weight channel in ``dtype`` (``bf16`` /
    ``fp16`` / ``fp32``): a 16-bit channel sends the weight matrices in it and keeps the output
    embedding (the LM head, sent once with a tied input embedding) and the vectors (norms,
    biases) in fp32, as the runtime does (``runtime.weight_wire.cast_on_wire``; SmolLM2-135M in
    bf16: 325.7 MB against 269.0 MB for every tensor in 2 bytes)."""
    b = DTYPE_BYTES[dtype]
    kept = model.vocab * model.hidden + model.vector_params if b < 4 else 0  # travels in fp32
    return b * (model.n_params - kept) + 4 * kept


def received_bytes(model: ModelSpec, gen: ParallelStrategy, dtype: str) -> float:
    """Bytes one generation device of strategy ``gen`` receives of a weight version: its share
    of :func:`wire_bytes` (``params_per_device`` of the ``n_params``)."""
    return wire_bytes(model, dtype) * params_per_device(model, gen) / model.n_params


def weight_sync_time(
    model: ModelSpec,
    gen: ParallelStrategy,
    *,
    train_devices: int,
    dtype: str,
    same_machine: bool,
    links: Links,
) -> tuple[float, float, str]:
    """Seconds to move the trained weights into the generation layout.

    Args:
        train_devices: devices of the training mesh (senders).
        same_machine: both meshes inside one machine (NVLink), else the network.

    Returns:
        ``(seconds, total bytes moved, link)``; link is ``"intra-node"`` (NVLink) or
        ``"inter-node"`` (the network).
    """
    full = wire_bytes(model, dtype)
    receive = received_bytes(model, gen, dtype)
    send = full * gen.dp / train_devices
    bw, link = (links.intra, "intra-node") if same_machine else (links.inter, "inter-node")
    return links.latency + max(receive, send) / bw, full * gen.dp, link


def swap_time(resident_bytes: float, links: Links) -> float:
    """Seconds to offload ``resident_bytes`` to host memory and load them back (per step),
    paid by each of several nodes that time-share one mesh."""
    return 2 * resident_bytes / links.host
