"""Memory per device of one node under a parallel strategy, in bytes.

Formulas (``P`` parameters held by the device, ``b`` bytes per element of ``dtype``):

- Training states, mixed-precision Adam (Rajbhandari et al. 2020, ZeRO, section 3.1):
  ``2P`` bf16 weights + ``2P`` gradients + ``12P`` fp32 master weights, momentum and
  variance = 16 bytes/parameter; fp32 training keeps no master copy (``4+4+8``, also 16).
  With ZeRO-3 / FSDP all three are divided by the sharding degree ``dp * cp``, plus two
  gathered layers (the one computing and the one prefetched).
- ``P`` per device: dense weights / ``(tp * pp)``; routed-expert weights / ``(tp * pp * ep)``
  (Megatron splits every matrix over TP and contiguous layer blocks over PP; the
  embedding is vocab-parallel and counted as if spread over the stages). ZeRO-3 then
  shards the dense part over ``dp * cp`` ranks and the expert part over the
  ``dp * cp / ep`` ranks that hold the same experts (expert data parallelism; EP re-uses
  the DP x CP ranks, so dividing experts by ``ep`` and again by ``dp * cp`` would count EP
  twice): fully sharded, each device keeps ``experts / (tp * pp * dp * cp)``. The RL
  trainer (training and forward-only nodes) keeps each routed expert whole on every TP rank
  (``runtime.parallel.tensor_parallel``: no expert TP), so there experts are divided by
  ``pp * ep`` only (:func:`sharded_params_per_device`); ``params_per_device`` (a generation
  replica, which vLLM's TP splits) keeps the ``tp``.
- Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation", eq. 5):
  ``34 * s * h / tp`` bytes per layer per token of a micro-batch with sequence
  parallelism; the ``5 * a * s^2`` attention-score term is dropped because FlashAttention
  (Dao et al. 2022) never stores the score matrix. With full recomputation (section 4) a
  layer keeps only its input, ``2 * s * h / tp``, plus one layer's full activations while it
  is recomputed. 1F1B pipelining keeps ``min(pp, m)`` micro-batches in flight on the first
  stage (Narayanan et al. 2021, section 2.2). Logits for the loss: fp32 values and their
  gradient, ``8 * V / tp`` bytes per token (``V = 1`` for a value or reward head). Scaled
  by ``b / 2`` for fp32.
- KV cache: ``2 * L * g * d * b`` bytes per token (K and V of every layer), divided by
  ``min(tp, g) * pp`` (heads and layers split; KV heads replicated when ``tp > g``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from compiler.models import ModelSpec
from compiler.strategy import ParallelStrategy

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ACT_BYTES_PER_TOKEN_HIDDEN = 34  # Korthikanti et al. 2022, eq. 1-5 (16-bit activations)
CKPT_BYTES_PER_TOKEN_HIDDEN = 2  # a checkpointed layer keeps its 16-bit input only


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device, by component."""

    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.kv_cache

    def to_dict(self) -> dict:
        return asdict(self)


def params_per_device(model: ModelSpec, s: ParallelStrategy) -> float:
    """Parameters one device holds before ZeRO sharding, elements."""
    dense = model.n_params - model.n_expert_params
    return dense / (s.tp * s.pp) + model.n_expert_params / (s.tp * s.pp * s.ep)


def sharded_params_per_device(model: ModelSpec, s: ParallelStrategy, sharded: bool) -> float:
    """Parameters whose states one device of the RL trainer keeps, elements: the dense part
    over ``tp * pp``, the routed experts over ``pp * ep`` (whole on every TP rank), then with
    ZeRO-3 the dense part over ``dp * cp`` and the experts over ``dp * cp / ep``."""
    dense = (model.n_params - model.n_expert_params) / (s.tp * s.pp)
    experts = model.n_expert_params / (s.pp * s.ep)
    if not sharded:
        return dense + experts
    return dense / (s.dp * s.cp) + experts / (s.dp * s.cp // s.ep)


def _layer_params_per_device(model: ModelSpec, s: ParallelStrategy) -> float:
    per_layer = model.attention_params_per_layer + model.dense_mlp_params_per_layer
    return per_layer / s.tp + model.expert_params_per_layer / s.ep  # experts whole on every TP rank


def micro_batch_tokens(tokens_per_step: float, s: ParallelStrategy, micro_batches: int) -> float:
    """Tokens of one micro-batch on one device (DP splits sequences, CP splits each one)."""
    return tokens_per_step / (s.dp * s.cp * micro_batches)


def training_memory(
    model: ModelSpec,
    s: ParallelStrategy,
    *,
    tokens_per_step: float,
    micro_batches: int,
    dtype: str,
    sharded: bool,
    checkpointing: bool,
) -> MemoryBreakdown:
    """Peak bytes per device of a train_step: states (16 bytes/param) + activations.

    Args:
        tokens_per_step: trajectories x (prompt + response) tokens in one optimizer step.
        micro_batches: gradient-accumulation micro-batches per DP rank (``m``).
        sharded: ZeRO-3 / FSDP over ``dp * cp``.
        checkpointing: full activation recomputation.
    """
    b = DTYPE_BYTES[dtype]
    p = sharded_params_per_device(model, s, sharded)
    gathered = 2 * b * _layer_params_per_device(model, s) if sharded and s.dp * s.cp > 1 else 0.0
    optimizer_bytes = 12 if b == 2 else 8
    return MemoryBreakdown(
        weights=b * p + gathered,
        gradients=b * p,
        optimizer=optimizer_bytes * p,
        activations=_activations(model, s, tokens_per_step, micro_batches, b, checkpointing, training=True),
    )


def inference_memory(
    model: ModelSpec, s: ParallelStrategy, *, tokens_per_step: float, micro_batches: int, dtype: str, sharded: bool
) -> MemoryBreakdown:
    """Peak bytes per device of a forward-only pass over the step's trajectories (reward
    model, critic values, reference log-probs): weights + one layer's activations + logits."""
    b = DTYPE_BYTES[dtype]
    gathered = 2 * b * _layer_params_per_device(model, s) if sharded and s.dp * s.cp > 1 else 0.0
    return MemoryBreakdown(
        weights=b * sharded_params_per_device(model, s, sharded) + gathered,
        activations=_activations(model, s, tokens_per_step, micro_batches, b, checkpointing=False, training=False),
    )


def _activations(
    model: ModelSpec, s: ParallelStrategy, tokens: float, m: int, b: int, checkpointing: bool, training: bool
) -> float:
    t = micro_batch_tokens(tokens, s, m)
    scale = b / 2
    full_layer = ACT_BYTES_PER_TOKEN_HIDDEN * t * model.hidden * scale / s.tp
    logits = (8 if training else 4) * t * model.output_dim / s.tp
    if not training:
        return full_layer + logits
    in_flight = min(s.pp, m)
    layers = model.n_layers // s.pp
    if checkpointing:
        kept = CKPT_BYTES_PER_TOKEN_HIDDEN * t * model.hidden * scale / s.tp
        return in_flight * layers * kept + full_layer + logits
    return in_flight * layers * full_layer + logits


def kv_bytes_per_sequence(model: ModelSpec, s: ParallelStrategy, seq_len: int, dtype: str) -> float:
    """KV-cache bytes of one sequence of ``seq_len`` tokens on one device of a replica: heads
    split over ``min(tp, g)`` ranks (a larger ``tp`` replicates KV heads, as vLLM and SGLang
    do), layers over ``pp``."""
    return model.kv_elements_per_token() * DTYPE_BYTES[dtype] * seq_len / (min(s.tp, model.n_kv_heads) * s.pp)


def generation_memory(model: ModelSpec, s: ParallelStrategy, *, concurrent: int, seq_len: int, dtype: str) -> MemoryBreakdown:
    """Bytes per device of an inference engine replica: full weights over ``tp * pp`` plus
    the KV cache of ``concurrent`` sequences of ``seq_len`` tokens."""
    return MemoryBreakdown(
        weights=DTYPE_BYTES[dtype] * params_per_device(model, s),
        kv_cache=concurrent * kv_bytes_per_sequence(model, s, seq_len, dtype),
    )
