"""Tiny causal LMs built in code from a ``transformers`` Qwen2 config (no download).

Presets are sized for CPU experiments: ``tiny-s`` (~78 k parameters) reaches partial
competence on 2-digit arithmetic in well under a minute on one core; ``tiny-arith``
(~1 M) learns more per example but costs ~5x more per step. Models are
fp32: bf16 matmuls are 16-25x slower on the CPUs this project targets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM


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


def build_model(
    preset: str,
    vocab_size: int,
    *,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    seed: int = 0,
) -> PreTrainedModel:
    """Build a freshly initialised fp32 ``Qwen2ForCausalLM`` from a named preset.

    Args:
        preset: a key of ``PRESETS``.
        vocab_size: rows of the (tied) embedding / LM head; ``len(tokenizer)``.
        pad_token_id / bos_token_id / eos_token_id: special ids written to the config
            (defaults match ``build_char_tokenizer``).
        seed: seeds ``torch`` for the initialisation, so equal seeds give equal weights.

    Returns:
        the model in eval mode, on CPU, fp32, with SDPA attention.

    Raises:
        ValueError: unknown ``preset`` (the message lists the known ones) or
            ``vocab_size < 1``.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny model preset {preset!r}; known presets: {sorted(PRESETS)}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    config = Qwen2Config(
        vocab_size=vocab_size,
        **asdict(PRESETS[preset]),
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.float().eval()
