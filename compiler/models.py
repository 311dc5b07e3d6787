"""Model shapes for the cost model: presets and ``transformers`` ``config.json`` files.

Owns :class:`ModelSpec` (layers, width, heads, vocabulary, experts) and the exact
parameter count of a Llama/Qwen2/Qwen3(-MoE)-style decoder computed from them:

- per layer, attention: ``h*(a*d) + 2*h*(g*d) + (a*d)*h`` (Q, K, V, O; ``a`` heads, ``g``
  KV heads, ``d`` head dim) + Q/K/V biases when ``qkv_bias`` (Qwen2) + Q/K norms (Qwen3);
- per layer, MLP: ``3*h*i`` (SwiGLU gate, up, down); for MoE ``E*3*h*i_e`` + router
  ``h*E`` (+ a shared expert when present); two RMSNorms ``2*h``;
- embeddings ``V*h``, plus an LM head ``V*h`` unless tied (a scalar value/reward head:
  ``h``); final norm ``h``.

Active parameters (the ones a token's FLOPs see) count ``k`` routed experts of ``E``.

Presets are ``config.json`` excerpts of the published models (Hugging Face model cards,
``areal_flow.models.presets.PUBLISHED_CONFIGS``), so presets and files go through the same
parser; which preset, file or hub id a name means is ``areal_flow.models.names``'s call.
``tiny-arith`` is this project's arithmetic model (``areal_flow.models.presets``, plain
data: Qwen2, hidden 128, 4 layers, vocab 50, the character tokenizer's), read without
importing torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

from areal_flow.models.names import ModelNameError, preset_key, resolve_name
from areal_flow.models.presets import CHAR_VOCAB_SIZE, GGUF_PRESETS, PUBLISHED_CONFIGS
from areal_flow.models.presets import PRESETS as TINY_PRESETS


class ModelSpecError(ValueError):
    """A model spec cannot be resolved or lacks a field; the message names the spec/file."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer (counts are elements, not bytes).

    Attributes:
        name: preset name or the config file path.
        n_layers: decoder layers.
        hidden: residual width ``h``.
        n_heads: query heads ``a``.
        n_kv_heads: key/value heads ``g`` (grouped-query attention).
        head_dim: per-head width ``d``.
        vocab: vocabulary size ``V``.
        intermediate: dense SwiGLU width ``i``.
        n_experts: routed experts per MoE layer (0 = dense).
        experts_per_token: routed experts a token uses (``k``).
        expert_intermediate: SwiGLU width of one expert ``i_e``.
        shared_expert_intermediate: width of an always-on shared expert (0 = none).
        tied_embeddings: LM head shares the embedding matrix.
        qkv_bias: Q/K/V projections have biases (Qwen2).
        qk_norm: per-head RMSNorm on Q and K (Qwen3).
        head: ``lm`` (a ``V x h`` LM head) or ``scalar`` (a PPO critic's value head or a
            reward model's score head: ``h x 1``, no vocabulary projection).
    """

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    n_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    head: str = "lm"

    @property
    def output_dim(self) -> int:
        """Width of the output head: ``V`` for an LM head, 1 for a scalar head."""
        return self.vocab if self.head == "lm" else 1

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def attention_params_per_layer(self) -> int:
        h, q, kv = self.hidden, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + self.vectors_per_layer

    @property
    def vectors_per_layer(self) -> int:
        """1-D tensors of one layer, elements: the two layer norms, the q/k/v biases and q/k norms
        where the model has them."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return ((q + 2 * kv) if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0) + 2 * self.hidden

    @property
    def vector_params(self) -> int:
        """1-D tensors (norm scales, attention biases), elements: every layer's and the final norm."""
        return self.n_layers * self.vectors_per_layer + self.hidden

    @property
    def expert_params_per_layer(self) -> int:
        """Routed-expert weights of one layer (sharded by EP), elements."""
        return self.n_experts * 3 * self.hidden * self.expert_intermediate

    @property
    def dense_mlp_params_per_layer(self) -> int:
        """MLP weights every token uses: dense MLP, or router + shared expert for MoE."""
        if not self.is_moe:
            return 3 * self.hidden * self.intermediate
        shared = 3 * self.hidden * self.shared_expert_intermediate
        shared_gate = self.hidden if self.shared_expert_intermediate else 0
        return self.hidden * self.n_experts + shared + shared_gate

    @property
    def embedding_params(self) -> int:
        """Embedding + output head (an LM head once if tied; ``h`` for a scalar head) + final
        norm, elements."""
        if self.head != "lm":
            return self.vocab * self.hidden + self.hidden + self.hidden
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @cached_property
    def n_expert_params(self) -> int:
        return self.n_layers * self.expert_params_per_layer

    @cached_property
    def n_params(self) -> int:
        """Total parameters, elements."""
        per_layer = self.attention_params_per_layer + self.dense_mlp_params_per_layer
        return self.n_layers * per_layer + self.n_expert_params + self.embedding_params

    @cached_property
    def n_active_params(self) -> int:
        """Parameters one token multiplies through (``k`` of ``E`` experts), elements."""
        if not self.is_moe:
            return self.n_params
        routed = self.n_layers * self.experts_per_token * 3 * self.hidden * self.expert_intermediate
        return self.n_params - self.n_expert_params + routed

    def kv_elements_per_token(self) -> int:
        """K and V cache entries of one token over all layers: ``2 * L * g * d``."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)


# Tiny presets (this project's, character vocabulary) and published models' config.json excerpts.
MODEL_PRESETS: dict[str, dict] = {
    **{name: p.config(CHAR_VOCAB_SIZE) for name, p in TINY_PRESETS.items()},
    **PUBLISHED_CONFIGS,
}


def spec_from_config(config: dict, name: str) -> ModelSpec:
    """Build a :class:`ModelSpec` from a ``transformers`` config dict.

    Reads ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``vocab_size``,
    ``intermediate_size`` (required) and ``num_key_value_heads``, ``head_dim``,
    ``tie_word_embeddings``, ``attention_bias``, ``num_experts``/``num_local_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``.

    Raises:
        ModelSpecError: a required key is missing (named, with ``name``), or the config uses
            DeepSeek's MLA (``kv_lora_rank``/``q_lora_rank``) or routed experts
            (``n_routed_experts``), which are refused rather than read as dense.
    """
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
    missing = [key for key in required if key not in config]
    if missing:
        raise ModelSpecError(f"model {name}: config lacks {', '.join(missing)}")
    unmodelled = [key for key in ("kv_lora_rank", "q_lora_rank", "n_routed_experts") if config.get(key)]
    if unmodelled:
        raise ModelSpecError(
            f"model {name} ({config.get('model_type', '?')}): {', '.join(unmodelled)} set: DeepSeek-style "
            "multi-head latent attention / routed experts are not modelled (reading it as a dense model would "
            "misstate its memory and time); use a Llama/Qwen2/Qwen3(-MoE) config or pin a manual allocation"
        )
    model_type = config.get("model_type", "")
    heads = int(config["num_attention_heads"])
    n_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    return ModelSpec(
        name=name,
        n_layers=int(config["num_hidden_layers"]),
        hidden=int(config["hidden_size"]),
        n_heads=heads,
        n_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        vocab=int(config["vocab_size"]),
        intermediate=int(config["intermediate_size"]),
        n_experts=n_experts,
        experts_per_token=int(config.get("num_experts_per_tok") or 0) if n_experts else 0,
        expert_intermediate=int(config.get("moe_intermediate_size") or config["intermediate_size"]) if n_experts else 0,
        shared_expert_intermediate=int(config.get("shared_expert_intermediate_size") or 0),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
    )


def resolve_model(spec: str) -> ModelSpec:
    """The shape of the model ``spec`` names, read without torch.

    What ``spec`` refers to is decided by ``areal_flow.models.names.resolve_name``, the step
    the run's weights loader (``areal_flow.models.hf.resolve_folder``) takes too; from it:
    a preset has its table's shape (a GGUF preset its published model's); a ``.gguf`` file
    its metadata; a folder its ``config.json``; a ``config.json`` file itself; a hub id the
    ``config.json`` of its snapshot in the local Hugging Face cache, else its preset's shape
    (``Qwen/Qwen2.5-7B``), else, for an instruction-tuned variant
    (``HuggingFaceTB/SmolLM2-135M-Instruct``, ``-chat``, ``-it``), its base preset's shape
    (their published config.json files agree on it). ``<preset>-rm`` (a reward model the
    runtime trains from the preset) has the preset's shape: its scalar head is noise next
    to the backbone.

    Raises:
        ModelSpecError: the name refers to nothing (the message of
            ``areal_flow.models.names.ModelNameError``, which lists the presets), a file or
            folder is missing or unreadable, or a hub id is neither cached nor a preset's.
    """
    if spec.lower().endswith("-rm") and not Path(spec).expanduser().exists():
        return resolve_model(spec[:-3])
    try:
        ref = resolve_name(spec)
    except ModelNameError as err:
        raise ModelSpecError(str(err)) from err
    if ref.kind in ("tiny", "preset", "shape"):
        return _preset_spec(ref.preset)
    if ref.kind == "gguf":
        if not ref.path.is_file():
            raise ModelSpecError(f"model.path {spec!r}: GGUF file not found")
        return spec_from_config(_gguf_config(ref.path), str(ref.path))
    if ref.kind == "hub" and ref.path is None:
        base = ref.preset or preset_key(re.sub(r"-(instruct|chat|it)$", "", spec.split("/")[1], flags=re.IGNORECASE))
        if base is None:
            raise ModelSpecError(
                f"model.path {spec!r}: a hub id not in the local Hugging Face cache and not a preset's (the run "
                "would download it; download it first or pass its folder or config.json)")
        return _preset_spec(base)
    if not ref.path.exists():
        raise ModelSpecError(f"model.path {spec!r}: no such file or folder")
    path = ref.path / "config.json" if ref.path.is_dir() else ref.path
    if not path.is_file():
        raise ModelSpecError(f"model.path {spec!r}: {ref.path} is not a model folder (no config.json) "
                             "nor a config.json file")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelSpecError(f"model config {path}: line {err.lineno}: {err.msg}") from err
    return spec_from_config(config, str(path))


def _preset_spec(key: str) -> ModelSpec:
    """The shape of preset ``key`` (a GGUF preset: its published model's)."""
    shape = GGUF_PRESETS[key].shape if key in GGUF_PRESETS else key
    return spec_from_config(MODEL_PRESETS[shape], shape)


def _gguf_config(path: Path) -> dict:
    """The ``transformers``-named shape of a GGUF file, from its metadata (``gguf`` package:
    ``<arch>.block_count``, ``.embedding_length``, ``.feed_forward_length``,
    ``.attention.head_count(_kv)``, the token list; tied embeddings = no ``output.weight``).

    Raises:
        ModelSpecError: a metadata key is missing (named).
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(key: str):
        f = reader.fields.get(key)
        if f is None:
            raise ModelSpecError(f"model {path}: GGUF metadata lacks {key}")
        return f.parts[f.data[0]]

    arch = bytes(field("general.architecture")).decode()
    return {
        "model_type": arch,
        "hidden_size": int(field(f"{arch}.embedding_length")[0]),
        "num_hidden_layers": int(field(f"{arch}.block_count")[0]),
        "num_attention_heads": int(field(f"{arch}.attention.head_count")[0]),
        "num_key_value_heads": int(field(f"{arch}.attention.head_count_kv")[0]),
        "intermediate_size": int(field(f"{arch}.feed_forward_length")[0]),
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
    }
