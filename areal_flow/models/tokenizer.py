"""Character-level tokenizer for the toy tasks, built offline (no download).

One token per character of a small fixed alphabet (digits, arithmetic symbols, space,
lowercase letters) plus four special tokens. Every encoded text starts with ``<bos>``;
callers append ``<eos>`` to training targets themselves. The result is a
``transformers.PreTrainedTokenizerFast`` so it saves with ``save_pretrained``; reload a
model folder's tokenizer with :func:`load_tokenizer`, not ``AutoTokenizer`` (see there).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from areal_flow.models.presets import ALPHABET, BOS, EOS, PAD, SPECIAL_TOKENS, UNK


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer.

    Ids: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3, then one id per
    character of ``ALPHABET`` (vocabulary size ``4 + len(ALPHABET)`` = 50). Characters
    outside the alphabet encode to ``<unk>``. ``encode(text)`` returns
    ``[bos] + one id per character``; ``decode(ids, skip_special_tokens=True)`` joins the
    characters back without separators, so ``decode(encode(t)[1:]) == t`` for texts over
    the alphabet. Padding side is left (the generation engine's convention).

    Returns:
        a ``PreTrainedTokenizerFast`` with ``pad/bos/eos/unk`` tokens set.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in ALPHABET:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every single character becomes its own "word" (spaces included).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        model_max_length=1024,
    )


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer saved in a model folder, exactly as its ``tokenizer.json`` defines it.

    ``AutoTokenizer.from_pretrained`` (transformers 5) picks the tokenizer class from the
    folder's ``config.json`` model type and, for ``qwen2``, rebuilds the Qwen2 byte-level
    pre-tokenizer in code instead of the saved one: with the character tokenizer next to a
    tiny Qwen2 model it silently drops every space (``"order 72"`` encodes as
    ``"order72"``), so a model warm-started on spaced text is run on unspaced text. Loading
    the file as it is gives the same ids as at training time; for Hub / GGUF-converted
    folders (e.g. SmolLM2) it matches ``AutoTokenizer`` (same ids, special tokens and chat
    template).

    Raises:
        OSError: ``folder`` holds no tokenizer files (from ``from_pretrained``).
    """
    return PreTrainedTokenizerFast.from_pretrained(folder)
