"""The project's own model shapes as plain data: the tiny presets and the character
tokenizer's symbols.

Owns the numbers that both sides need: ``areal_flow.models.tiny`` builds the models
from them and ``areal_flow.models.tokenizer`` the tokenizer, while the compiler
(``compiler.models``) reads the same shapes to cost a plan. It must import nothing but
the standard library (no torch, no transformers), so tracing and compiling stay light.
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
    """Architecture of one tiny preset (Qwen2: RMSNorm, RoPE, SwiGLU MLP, GQA).

    Attributes:
        hidden_size: model width (residual stream), elements.
        intermediate_size: SwiGLU MLP width, elements.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads; ``hidden_size`` must be a multiple of it.
        num_key_value_heads: key/value heads (grouped-query attention).
        max_position_embeddings: longest sequence (prompt + response), tokens.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 256


PRESETS: dict[str, TinyPreset] = {
    # ~78 k parameters: unit tests (milliseconds per step) and the fast arithmetic demo
    # (2-digit +/-: ~30 % greedy accuracy after a ~35 s SFT on one core).
    "tiny-s": TinyPreset(64, 128, 2, 4, 2),
    # ~1.0 M parameters: the arithmetic RL demo (SFT warm start + RL on CPU).
    "tiny-arith": TinyPreset(128, 512, 4, 4, 2),
    # ~2.6 M parameters: same depth, wider; for longer runs.
    "tiny-arith-wide": TinyPreset(192, 768, 5, 6, 2),
}
