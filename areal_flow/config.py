"""Experiment configuration: the typed dataclasses of every config key.

Owns the schema: each key, its type, default and one-line doc (the CLI help and
``areal-flow config`` read them), and the checks of a single key's value
(``__post_init__``). Loading YAML files and dotted overrides into it, and the errors that
name the file and line, are ``areal_flow.config_load``. It must not act on the config.

The YAML key ``async`` (a Python keyword) is the field ``async_``. Names users know from
AReaL and Hugging Face (``training.seed``, ``training.bf16``, ``actor.optimizer.lr``, ...)
are aliases of our keys (``areal_flow.config_keys.ALIASES``; ``areal-flow config`` lists
them). The sections of how a run operates (``scheduler``, ``eval``, ``logging``, ``debug``) are
``areal_flow.config_run``; ``cluster`` and ``compile`` are ``areal_flow.config_compile``; the knobs
graphs pass to ops (``advantage``, ``replay``, ``reward``) are ``areal_flow.config_knobs``; all are
re-exported here, as is :class:`ConfigError` (``areal_flow.config_keys``).
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any

from areal_flow.algorithms.config import LossConfig
from areal_flow.dtypes import AUTO, dtype_name
from areal_flow.config_compile import ClusterConfig, CompileConfig
from areal_flow.config_keys import ConfigError
from areal_flow.config_knobs import AdvantageKnobs, ReplayKnobs, RewardKnobs
from areal_flow.config_run import DebugConfig, EvalConfig, LoggingConfig, SchedulerConfig, parse_kill_at
from areal_flow.tasks.held_out import check_held_out
from areal_flow.tasks.dataset_check import DatasetValueError, check_dataset
from areal_flow.graph import DEFAULT_MAX_STALENESS

CPU_KERNELS = ("auto", "on", "off")
"""The values of ``gen.cpu_kernels``."""
LM_HEAD_WORDS = ("auto", "engine", "mixed")
"""The values of ``gen.lm_head_dtype`` besides a dtype's spelling."""


@dataclass
class ModelConfig:
    path: str = "tiny-arith"
    """Preset name, case ignored (tiny-arith, smollm2-135m), HF folder, .gguf file or hub id org/name;
    compile and run resolve it alike (areal_flow.models.names)."""
    dtype: str = "float32"
    """float32 (fp32), bfloat16 (bf16), float16 (fp16) or auto; spellings are normalised to the torch name; auto is
    bfloat16 where the device multiplies bf16 in hardware (CUDA compute capability >= 8.0; a CPU with AVX-512 BF16 or
    AMX whose timed bf16 product runs >= 1.3x fp32's) and float32 elsewhere, decided by each worker (areal_flow.dtypes.model_dtype; the trainer prints its choice). The
    generation engine loads the policy in it (and decodes in gen.dtype); trainers keep fp32 master weights and optimizer state and run
    forward/backward under torch.autocast in it (fp16 with dynamic loss scaling: algorithms/loss_scale.py); log-softmax
    and the importance ratio stay fp32 (on CPU the packed attention too: torch's bf16 CPU attention backward is ~3x
    slower). Default float32 (graphs/arith_chat_grpo.yaml: auto). On the 2-core AMX box (bench/train_throughput.py,
    docs/PERFORMANCE.md "The bf16 trainer"): bf16 gives no reliable gain for the tiny models and speeds a SmolLM2-135M
    step up 1.4-1.6x, at a cost in log-prob accuracy (autocast: mean |logp - logp_fp32| 0.023 nats on text, so
    the trainer's log-probs drift from an fp32 engine's; decoupled PPO's proximal log-probs come from the trainer's own forward, in the same dtype).
    Aliases: training.bf16 / training.fp16 = true."""

    def __post_init__(self) -> None:
        try:
            self.dtype = dtype_name(self.dtype, "model.dtype", extra=(AUTO,))
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass
class DatasetConfig:
    name: str = "arithmetic"
    """Task: arithmetic (synthetic, seeded), longtail (counting with Zipf-distributed answer lengths,
    areal_flow.tasks.longtail), gsm8k, the env tasks support_desk, guess_number and tool_multiply (python_math),
    reasoning_gym:<dataset> (any reasoning-gym dataset, areal_flow.tasks.rgym; reward fn reasoning_gym), or
    verifiers:<env id>, the dataset of a verifiers environment (areal_flow.tasks.verifiers_data; env=verifiers:<env id>)."""
    path: str = ""
    """Data file or folder (gsm8k); empty = the shipped default."""
    max_digits: int = 3
    """Operands of 1..max_digits digits (arithmetic), 2..max_digits (tool_multiply, 2..4); support_desk: order numbers."""
    ops: str = "+-"
    """Arithmetic: operators drawn from ('+', '-' or '+-')."""
    prompt_style: str = "plain"
    """Arithmetic: 'plain' ("37+58=") or 'chat' ("What is 37 + 58? Answer with just the number."); reasoning_gym:
    'plain' (the question) or 'chat' (reasoning-gym's default system prompt, asking for <answer>...</answer>, then
    the question)."""
    options: dict[str, Any] = field(default_factory=dict)
    """reasoning_gym:<dataset>: keyword arguments of the dataset's config class (e.g. min_terms: 2), seed and size
    excepted (the run sets them); verifiers:<env id>: the environment's load_environment arguments."""

    def __post_init__(self) -> None:
        """Raises ConfigError for a value no task takes (:func:`check_dataset`)."""
        try:
            check_dataset(self)
        except DatasetValueError as exc:
            raise ConfigError(str(exc)) from None


@dataclass
class GenerationConfig:
    n_samples: int = 8
    """Responses per prompt (the group size)."""
    max_new_tokens: int = 8
    """Response length limit, tokens."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_batch_size: int = 64
    """Sequences decoded together by the engine (continuous batching slots)."""
    engine: str = "embedded"
    """Generation engine of graphs that pass it to ops.generate: embedded or vllm."""
    vllm_compile: bool = False
    """engine=vllm only: compile the model (vLLM-CPU's dynamo trace + inductor, its deployed mode; needs a C++
    compiler, the first step of each batch shape compiles) instead of running it eagerly (enforce_eager). Off by
    default: bench/engine_throughput.py measured only generation, not weight reloads into compiled graphs
    (docs/PERFORMANCE.md, "Generation engine")."""
    interruptible: bool = True
    """Weight updates pause in-flight responses, load the new version and resume them (AReaL's interruptible
    generation); false: the generator admits no new response and finishes the in-flight ones with the old
    weights before it loads the new ones (ops.generate nodes, runtime.executors.generate; multi-turn rollouts
    always pause and resume)."""
    dtype: str = "float32"
    """Embedded engine's weights and KV cache: float32, bfloat16, float16 or auto (spellings as model.dtype).
    auto times one decode step in fp32 and in bf16 (fp16 on CUDA) at engine start and takes the 16-bit type
    when it is >= 1.3x faster (runtime/engines/precision.py): SmolLM2-135M on this AMX CPU gets bf16 (its graphs'
    yaml set auto); the main job's 1 M model is near the line (measured 0.52x once, 2.17x on 2026-12-06), so its
    yaml keeps float32. Logits and sampling
    stay fp32, but bf16 behavior log-probs differ from the trainer's fp32 recomputation (SmolLM2: mean 0.034, max
    0.31-0.81 nats; fp32: 9e-6; docs/PERFORMANCE.md, "bf16 engine"), so use bf16/auto with
    train.loss.use_decoupled_loss=true, where the trainer's recomputation is the PPO reference and behavior
    log-probs only enter the capped behavior importance weight. A 16-bit engine gets the weight matrices of an update
    in its dtype (half their bytes; auto: the dtype the engine chose, which it announces to the trainer at start;
    vectors and the LM head as trained), as each sync_weights' weights_dtype says (areal_flow.dtypes.weights_dtype,
    runtime.weight_wire.cast_on_wire)."""
    lm_head_dtype: str = "auto"
    """Embedded engine's final norm and LM head (the product that makes the logits): auto (default: mixed for a
    bfloat16 engine where mixed runs, else float32), float32, engine
    (gen.dtype's), mixed (the norm in fp32, the product with bf16 inputs and weights and fp32 sums and logits:
    no bf16 rounding of the logits, half the bytes of float32; CPUs with AMX or AVX-512 BF16 and gen.cpu_kernels
    loaded, float32 elsewhere with a warning), or a spelling of model.dtype. With gen.dtype=bfloat16 the rest of the decoder runs in
    bf16 and the last residual is cast up; logits and sampling are fp32 either way (measured: docs/PERFORMANCE.md,
    "bf16 engine" and "Fused CPU kernels")."""
    cpu_kernels: str = "auto"
    """Embedded engine's fused CPU kernels (runtime/engines/csrc: decode and prefill attention, residual add + RMSNorm, RoPE,
    SiLU gate, the draw, and on CPUs with AVX-512 BF16 but no AMX a bfloat16 engine's layer products; built once per
    machine with the system C++ compiler): auto (default: used where the engine
    runs on CPU in float32 or bfloat16 and the build works; otherwise PyTorch's ops, with a warning naming why if the
    build failed), on (the kernels, or a clear error) or off (PyTorch's ops: SDPA and layer_ops; an fp32 engine's
    logits then move by ~1e-6, their sums in another order). YAML's bare on / off (booleans) mean the words.
    Measured: docs/PERFORMANCE.md, "Fused CPU kernels" and "A CPU without bf16 products"."""


@dataclass
class EnvConfig:
    name: str = ""
    """Environment of graphs with ops.rollout: a name registered with areal_flow.envs.register_env, or
    verifiers:<env id or module>, a verifiers environment (env.config: its load_environment arguments)."""
    max_turns: int = 8
    """Policy turns per episode at most."""
    gamma: float = 1.0
    """Discount per turn of the episode return (Sutton & Barto eq. 3.8, one step per turn)."""
    step_timeout_s: float = 30.0
    """Seconds one env.reset / env.step may take; past it the episode fails (counted, left out)."""
    config: dict[str, Any] = field(default_factory=dict)
    """Keys merged into every episode's env config (ops.rollout env_config; the dataset row's own keys win),
    e.g. turn_cost: 0.2 for support_desk and guess_number (the reward of a turn that does not end the episode)."""


@dataclass
class WarmStartConfig:
    enabled: bool = True
    """Supervised warm start before RL (cached on disk, keyed by this config)."""
    steps: int = 300
    """SFT optimizer steps."""
    batch_size: int = 64
    """SFT problems per step."""
    lr: float = 3e-3
    """SFT learning rate."""
    teacher_bug_rate: float = 0.0
    """Fraction of carry/borrow problems whose demonstration shows a buggy column procedure (a misconception RL must correct);
    arithmetic, and reasoning-gym entries of two terms joined by + or - (basic_arithmetic, chain_sum)."""


@dataclass
class TrainConfig:
    algorithm: str = "grpo"
    """Registered algorithm name (areal_flow.algorithms)."""
    steps: int = 40
    """Optimizer steps (policy versions) of RL."""
    batch_size: int = 8
    """Prompt groups per optimizer step (B): the one key of B (compile.prompts_per_step is an alias); the plan
    carries it on the data edge into each train_step (batch_groups)."""
    micro_batch_size: int = 32
    """Sequences per forward/backward micro-batch; gradients of a step's micro-batches are summed
    before the one optimizer step."""
    gradient_accumulation_steps: int = 0
    """Micro-batches per DP rank of each train_step's optimizer step, as HF users give it (training.*); 0 = from
    micro_batch_size. N > 0 is what the plan records (compile.micro_batches) and the trainer runs: the rows of one
    step (batch_size x gen.n_samples) over the DP ranks must divide by N (the compiler keeps only such dp, and
    refuses an allocation whose dp does not); it cannot be combined with max_tokens_per_micro_batch."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one forward/backward micro-batch (dynamic micro-batches, as AReaL's max_tokens_per_mb);
    0 = micro_batch_size sequences. Sequences are grouped longest first into micro-batches whose computed
    tokens stay within it (padded: rows x longest row; packed: the sum; with shared_prefix, rows sharing a prefix
    are kept together and the prefix counts once). Must be >= the longest prompt +
    response; with several DP ranks it is refused (each rank must run as many micro-batches as the others)."""
    pack_sequences: bool = True
    """Pack each micro-batch's sequences into one row without padding (position ids restart per sequence,
    attention stays inside each; areal_flow.algorithms.micro_batches), as AReaL and verl train. Same loss and
    gradient as padded; false = padded rows (pipeline and context parallelism run padded either way)."""
    shared_prefix: bool = True
    """With pack_sequences: rows of a micro-batch that begin with the same tokens (a GRPO group's prompt) run them
    once, each row's own tail attending to them (Prefix Grouper's shared-prefix forward;
    areal_flow.algorithms.shared_prefix). Same log-probs and gradient as running each row whole."""
    lr: float = 1e-3
    """AdamW learning rate."""
    lr_warmup_steps: int = 0
    """Train steps of a linear warm-up of the learning rate to train.lr: step t (0-based) runs at
    lr * min(1, (t + 1) / lr_warmup_steps), every train_step (policy and critic, one process or
    several ranks; areal_flow.algorithms.lr_schedule); 0 = train.lr from the first step."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global L2 norm."""
    loss: dict[str, Any] = field(default_factory=dict)
    """Policy-loss knobs changed from the algorithm's defaults (fields of LossConfig), e.g. clip_eps_high: 0.28; the
    compiler merges them with the algorithm's defaults into each train_step's loss in the plan (attrs.loss)."""
    checkpoint_every: int = 0
    """Write a checkpoint to <out_dir>/<name>/checkpoints/version_<v>/ every this many steps and at the last step (the trained models, optimizer state, RNGs, data cursor; atomic; what resume continues from; a resume of a finished run says it is complete); 0 = only the final model."""
    keep_checkpoints: int = 0
    """Complete checkpoints kept: after a new one is complete, older ones beyond the newest this many are deleted
    (a torn one is never counted); 0 = keep all. May change on a resume."""
    max_nonfinite_steps: int = 3
    """Train steps in a row with a NaN/inf loss or gradient norm (each skipped, counted, its batch kept
    under <run>/nonfinite/) before the run stops; >= 1."""

    def __post_init__(self) -> None:
        if isinstance(self.max_nonfinite_steps, bool) or not isinstance(self.max_nonfinite_steps, int) \
                or self.max_nonfinite_steps < 1:
            raise ConfigError(f"train.max_nonfinite_steps={self.max_nonfinite_steps!r}: must be an integer >= 1")
        valid = LossConfig.field_names()
        for key in self.loss:
            if key not in valid:
                near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
                hint = f"; did you mean 'train.loss.{near[0]}'?" if near else ""
                raise ConfigError(f"unknown config key 'train.loss.{key}'{hint}")
        try:
            LossConfig(**self.loss)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"train.loss: {exc}") from None


@dataclass
class AsyncConfig:
    max_staleness: int = DEFAULT_MAX_STALENESS
    """k: a sample is trained at most k versions after it was generated; 0 = synchronous. The graphs here pass it to
    ops.train_step(max_staleness=...), whose default is the same 2 (areal_flow.graph.DEFAULT_MAX_STALENESS). With k >= 1
    the compiler turns on the decoupled PPO loss (train.loss.use_decoupled_loss) of PPO-clip algorithms."""


@dataclass
class ExperimentConfig:
    name: str = "experiment"
    """Run name: outputs go to <out_dir>/<name>/."""
    seed: int = 1
    """Seed of data, sampling and initialisation."""
    out_dir: str = "runs"
    """Folder for TensorBoard events, trajectories and the final model."""
    keep_old_runs: int = 3
    """Earlier runs of this name kept beside the new one: a new run moves <out_dir>/<name> aside to
    <name>.old-<stamp>, then deletes all but the newest this many of those folders (0 = keep none)."""
    resume: str = ""
    """Continue a run from its last complete checkpoint (train.checkpoint_every): '' = a new run (an earlier folder of the name is moved aside), 'auto' = resume <out_dir>/<name> if it holds a complete checkpoint, else a new run, or the run folder itself (what --resume sets). Either scheduler; another compile.allocation of the train_step reshards its checkpoint (docs/RESUME.md)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    gen: GenerationConfig = field(default_factory=GenerationConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    advantage: AdvantageKnobs = field(default_factory=AdvantageKnobs)
    reward: RewardKnobs = field(default_factory=RewardKnobs)
    replay: ReplayKnobs = field(default_factory=ReplayKnobs)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def __post_init__(self) -> None:
        try:
            check_held_out(self.dataset.name, self.eval.n_test)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.train.gradient_accumulation_steps < 0:
            raise ConfigError(f"train.gradient_accumulation_steps={self.train.gradient_accumulation_steps}: must be >= 0")
        if self.train.max_tokens_per_micro_batch < 0:
            raise ConfigError(f"train.max_tokens_per_micro_batch={self.train.max_tokens_per_micro_batch}: must be "
                              ">= 0 (0 = micro_batch_size sequences per micro-batch)")
        if self.train.gradient_accumulation_steps and self.train.max_tokens_per_micro_batch:
            raise ConfigError(f"train.gradient_accumulation_steps={self.train.gradient_accumulation_steps} with "
                              f"train.max_tokens_per_micro_batch={self.train.max_tokens_per_micro_batch}: a token "
                              "budget decides the micro-batches itself; set one of them to 0")
        if self.resume not in ("", "auto") and not os.path.isdir(self.resume):
            boolean = " (YAML reads yes/no/true/false as a boolean)" if self.resume in ("True", "False") else ""
            raise ConfigError(f"resume={self.resume!r}{boolean}: expected '' (a new run), 'auto' (resume <out_dir>/<name> if it "
                              "holds a complete checkpoint, else start) or an existing run folder (what --resume sets)")
        for entry in self.debug.kill_at:
            parse_kill_at(entry)
        if self.scheduler.type not in ("local", "ray"):
            raise ConfigError(f"scheduler.type={self.scheduler.type!r}: expected 'local' or 'ray'")
        for key, value in (("keep_old_runs", self.keep_old_runs), ("train.checkpoint_every", self.train.checkpoint_every),
                           ("train.keep_checkpoints", self.train.keep_checkpoints),
                           ("train.lr_warmup_steps", self.train.lr_warmup_steps),
                           ("scheduler.max_restarts", self.scheduler.max_restarts),
                           ("scheduler.threads_per_worker", self.scheduler.threads_per_worker),
                           ("async.max_staleness", self.async_.max_staleness),
                           ("warm_start.steps", self.warm_start.steps), ("gen.temperature", self.gen.temperature)):
            if value < 0:
                raise ConfigError(f"{key}={value}: must be >= 0")
        for key, value in (("train.batch_size", self.train.batch_size), ("gen.n_samples", self.gen.n_samples),
                           ("train.steps", self.train.steps), ("gen.max_new_tokens", self.gen.max_new_tokens),
                           ("warm_start.batch_size", self.warm_start.batch_size),
                           ("env.max_turns", self.env.max_turns)):
            if value < 1:
                raise ConfigError(f"{key}={value}: must be >= 1")
        for key, value in (("train.lr", self.train.lr), ("warm_start.lr", self.warm_start.lr)):
            if not (math.isfinite(value) and value > 0):  # found by the new-user trial: -1 and nan compiled
                raise ConfigError(f"{key}={value}: must be a finite number > 0")
        if not self.name or self.name in (".", "..") or "/" in self.name or "\\" in self.name:
            raise ConfigError(f"name={self.name!r}: must be a plain folder name (runs go to <out_dir>/<name>/; no "
                              "'/', not empty)")
        if not 0 <= self.warm_start.teacher_bug_rate <= 1:
            raise ConfigError(f"warm_start.teacher_bug_rate={self.warm_start.teacher_bug_rate}: must be in [0, 1]")
        if not 0 < self.gen.top_p <= 1:
            raise ConfigError(f"gen.top_p={self.gen.top_p}: must be in (0, 1]")
        # YAML 1.1 reads a bare on / off as a boolean, which the str field holds as 'True' / 'False'
        self.gen.cpu_kernels = {"true": "on", "false": "off"}.get(str(self.gen.cpu_kernels).lower(),
                                                                 self.gen.cpu_kernels)
        if self.gen.cpu_kernels not in CPU_KERNELS:
            raise ConfigError(f"gen.cpu_kernels={self.gen.cpu_kernels!r}: expected one of {', '.join(CPU_KERNELS)}")
        try:
            dtype_name(self.gen.dtype, "gen.dtype", extra=(AUTO,))
            dtype_name(self.gen.lm_head_dtype, "gen.lm_head_dtype", extra=LM_HEAD_WORDS)
        except ValueError as e:
            raise ConfigError(str(e)) from None
