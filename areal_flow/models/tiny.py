"""Tiny causal LMs built in code from a ``transformers`` Qwen2 or Qwen3-MoE config (no download).

The presets' shapes are plain data in ``areal_flow.models.presets`` (the compiler reads
them without importing torch).

Presets are sized for CPU experiments: ``tiny-s`` (~78 k parameters) reaches partial
competence on 2-digit arithmetic in well under a minute on one core; ``tiny-arith``
(~1 M) learns more per example but costs ~5x more per step; ``tiny-moe`` (Qwen3-MoE,
8 experts, top-2) is the one for expert parallelism. Models are built fp32.

bf16 does not pay for them (measured with ``torch.profiler``, torch 2.13, 1 thread, on the
2-core AMX / AVX-512-bf16 box under a load average of 6): a ``tiny-arith`` forward + backward
over ``[32, 64]`` tokens takes 0.33 s in fp32 and 0.33 s under bf16 autocast. bf16 cuts the
matmuls 4x (``aten::mm`` 158 -> 41 ms) but the CPU flash-attention backward is 6x slower in
bf16 (5 -> 34 ms a call) and autocast adds 345 dtype casts (``aten::copy_``); a decode-sized
``[1, 128] @ [128, 512]`` linear is 3.7x slower in bf16 (6 -> 24 us: a fixed cost per call).
The earlier "16-25x slower" did not reproduce with 1 thread; with 2 threads on the shared 2
cores single linears stall when another process holds the second core (measured: a
``[64, 128] @ [128, 512]`` bf16 linear at 2,904 us against 38 us in fp32, and a ``[1, 128]``
fp32 one at 2,133 us against 6 us on 1 thread), so dtype comparisons need 1 thread and
interleaved runs.
``bench/train_throughput.py`` has the whole-step numbers; SmolLM2-135M gains from bf16.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from areal_flow.models.presets import PRESETS


def build_model(
    preset: str,
    vocab_size: int,
    *,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    seed: int = 0,
) -> PreTrainedModel:
    """Build a freshly initialised fp32 ``Qwen2ForCausalLM`` (``Qwen3MoeForCausalLM`` for a
    preset with experts) from a named preset (its shape: ``TinyPreset.config``).

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
    shape = PRESETS[preset].config(vocab_size)
    moe = shape.pop("model_type") == "qwen3_moe"
    config = (Qwen3MoeConfig if moe else Qwen2Config)(
        **shape,
        rms_norm_eps=1e-6,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = (Qwen3MoeForCausalLM if moe else Qwen2ForCausalLM)(config)
    return model.float().eval()


def build_in_code(spec: str, seed: int = 0):
    """``(model, tokenizer)`` for a model name that needs no weights file: a tiny preset
    (:func:`build_model`) or a published shape (``PUBLISHED_CONFIGS``, e.g. ``SmolLM2-135M``,
    ``Qwen2.5-0.5B``: that architecture, seeded random fp32 weights, SDPA attention), each with
    the character tokenizer (its pad/bos/eos ids in the config). For benchmarks on a machine
    without model files: a random model's speed is a trained one's. None for any other name
    (a GGUF preset, folder, file or hub id: ``areal_flow.models.hf.load_model`` loads those).
    """
    from areal_flow.models.names import resolve_name
    from areal_flow.models.presets import CHAR_VOCAB_SIZE, PUBLISHED_CONFIGS
    from areal_flow.models.tokenizer import build_char_tokenizer

    ref = resolve_name(spec)
    if ref.kind not in ("tiny", "shape"):
        return None
    tokenizer = build_char_tokenizer()
    if ref.kind == "tiny":
        return build_model(ref.preset, CHAR_VOCAB_SIZE, seed=seed), tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(PUBLISHED_CONFIGS[ref.preset])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.float().eval(), tokenizer
