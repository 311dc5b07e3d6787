"""Typed configuration of the compiler: the cluster and the compile knobs.

Owns the two dataclasses the main experiment config embeds (``cluster:`` and
``compile:`` in YAML). They are plain OmegaConf-compatible dataclasses (no ``Literal``:
the allowed values are checked by :func:`check_config`, which names the key). It must not
act on the values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("async", "sync")
DTYPES = ("bf16", "fp16", "fp32")
LENGTH_KINDS = ("fixed", "uniform", "lognormal")


class CompileConfigError(ValueError):
    """A compiler config key has a bad value; the message names the key."""


@dataclass
class ClusterConfig:
    n_nodes: int = 1
    """Machines in the cluster."""
    n_gpus_per_node: int = 1
    """Devices per machine (GPUs; CPU worker processes when gpu='cpu')."""
    gpu: str = "cpu"
    """Device preset: H100, H200, A100-80G, H800, L40S or cpu (see compiler.hardware)."""


@dataclass
class LengthDistConfig:
    kind: str = "lognormal"
    """Response-length distribution: fixed, uniform or lognormal (compiler.lengths); lengths are fractions of
    the response budget (max_new_tokens), clipped to [1 token, the budget]."""
    mean: float = 0.35
    """fixed: every response's length; lognormal: mean of the unclipped distribution (clipping at the budget
    lowers it); fractions of max_new_tokens."""
    sigma: float = 1.0
    """lognormal: standard deviation of log(length); larger = longer tail (mean 0.35, sigma 1: ~6% cut at the budget)."""
    low: float = 0.0
    """uniform: shortest response, fraction of max_new_tokens."""
    high: float = 1.0
    """uniform: longest response, fraction of max_new_tokens."""


@dataclass
class CompileConfig:
    mode: str | None = None
    """'async': generation and training overlap (bounded staleness); 'sync': they alternate; null = from the
    graph (sync exactly when the staleness bound k of the edge into the policy's train_step is 0). k itself is
    set only on that edge (train_step(max_staleness=...), async.max_staleness in the graphs here)."""
    samples_per_prompt: int | None = None
    """Responses per prompt (group size); None = the generate node's n_samples."""
    max_prompt_len: int = 512
    """Prompt length budget, tokens."""
    max_new_tokens: int | None = None
    """Response length budget, tokens; None = the generate node's max_new_tokens."""
    length_dist: LengthDistConfig = field(default_factory=LengthDistConfig)
    """Distribution of response lengths the time model assumes (default: a long tail, lognormal)."""
    decode_step_overhead_s: float = 0.002
    """ASSUMED fixed seconds per decode step of an engine besides its memory/compute time (scheduling,
    sampling, kernel launches; compiler.decode)."""
    micro_batches: int | None = None
    """Micro-batches per DP rank per training step; None = from train.gradient_accumulation_steps when set,
    else from train.micro_batch_size (compiler.program); without a config, the power of two that fits memory
    and gives the shortest predicted step (pipeline bubble vs per-micro-batch FSDP traffic and collective
    latencies)."""
    fsdp_overlap: float = 1.0
    """ASSUMED fraction of the data-parallel traffic (FSDP gathers/reduce-scatters, DDP all-reduce) hidden behind
    compute, up to the compute available to hide it (1.0: ideal prefetching; 0: none; compiler.timing)."""
    activation_checkpointing: bool | None = None
    """Recompute each layer in the backward pass instead of storing its activations, for the train_steps:
    true = on for every train_step; false = never (the search keeps only plans that fit without it);
    null (auto, model.activation_checkpointing=auto) = the compiler turns it on for a train_step only when
    its memory would not fit without it. The plan records the choice per node (compile --plan shows 'ac')."""
    dtype: str = "bf16"
    """Parameter/activation dtype: bf16, fp16 (mixed-precision Adam) or fp32."""
    optimizer_sharding: bool = True
    """Shard weights, gradients and Adam states over DP ranks (ZeRO-3 / FSDP)."""
    mfu: float = 0.4
    """Assumed model FLOPs utilization: achieved / peak FLOP/s for matmul-bound phases."""
    bandwidth_efficiency: float = 0.8
    """Assumed achieved / peak bandwidth of HBM, NVLink, network and PCIe."""
    memory_fraction: float = 0.9
    """Fraction of device memory a plan may fill (rest: CUDA context, NCCL, fragmentation)."""
    allocation: str | None = None
    """Manual allocation, e.g. 'gen:d4t2 + train:d2t2p2' (grammar: compiler.allocation)."""
    pins: dict[str, str] = field(default_factory=dict)
    """Node (or alias gen/train) -> strategy fixed before the search, e.g. {'gen': 'd4t2'}."""
    top_k: int = 5
    """Alternative plans kept and shown."""


def check_config(cluster: ClusterConfig, cfg: CompileConfig) -> None:
    """Check value ranges that the type annotations cannot express.

    Raises:
        CompileConfigError: naming the key, its value and what is allowed.
    """
    def bad(key: str, value, allowed: str) -> CompileConfigError:
        return CompileConfigError(f"{key}={value!r}: {allowed}")

    if cluster.n_nodes < 1:
        raise bad("cluster.n_nodes", cluster.n_nodes, "must be >= 1")
    if cluster.n_gpus_per_node < 1:
        raise bad("cluster.n_gpus_per_node", cluster.n_gpus_per_node, "must be >= 1")
    if cfg.mode is not None and cfg.mode not in MODES:
        raise bad("compile.mode", cfg.mode, f"must be one of {', '.join(MODES)}")
    if cfg.dtype not in DTYPES:
        raise bad("compile.dtype", cfg.dtype, f"must be one of {', '.join(DTYPES)}")
    for key in ("max_prompt_len", "top_k"):
        if getattr(cfg, key) < 1:
            raise bad(f"compile.{key}", getattr(cfg, key), "must be >= 1")
    for key in ("samples_per_prompt", "max_new_tokens", "micro_batches"):
        value = getattr(cfg, key)
        if value is not None and value < 1:
            raise bad(f"compile.{key}", value, "must be >= 1 (or null)")
    if cfg.decode_step_overhead_s < 0:
        raise bad("compile.decode_step_overhead_s", cfg.decode_step_overhead_s, "must be >= 0")
    check_length_dist(cfg.length_dist)
    for key in ("mfu", "bandwidth_efficiency", "memory_fraction"):
        value = getattr(cfg, key)
        if not 0 < value <= 1:
            raise bad(f"compile.{key}", value, "must be in (0, 1]")
    if not 0 <= cfg.fsdp_overlap <= 1:
        raise bad("compile.fsdp_overlap", cfg.fsdp_overlap, "must be in [0, 1]")


def check_length_dist(d: LengthDistConfig) -> None:
    """Raises CompileConfigError naming the ``compile.length_dist`` key that is out of range."""
    key = "compile.length_dist"
    if d.kind not in LENGTH_KINDS:
        raise CompileConfigError(f"{key}.kind={d.kind!r}: must be one of {', '.join(LENGTH_KINDS)}")
    if d.kind in ("fixed", "lognormal") and not 0 < d.mean <= (1 if d.kind == "fixed" else 10):
        raise CompileConfigError(f"{key}.mean={d.mean!r}: must be in (0, {1 if d.kind == 'fixed' else 10}] "
                                 "(a fraction of max_new_tokens)")
    if d.kind == "lognormal" and not 0 < d.sigma <= 5:
        raise CompileConfigError(f"{key}.sigma={d.sigma!r}: must be in (0, 5]")
    if d.kind == "uniform" and not 0 <= d.low <= d.high <= 1:
        raise CompileConfigError(f"{key}.low={d.low!r}, high={d.high!r}: need 0 <= low <= high <= 1")
