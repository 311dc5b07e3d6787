"""Held-out evaluation: greedy accuracy of a policy on task problems."""

from __future__ import annotations

import torch

from areal_flow.ops.generate import encode_prompt
from runtime.engines.generation import GenerationEngine, GenerationRequest, SamplingParams


def greedy_accuracy(
    engine_or_model, tokenizer, task, problems: list[dict], max_batch_size: int = 128, chat_template: bool | None = None
) -> float:
    """Fraction of ``problems`` whose greedy (temperature 0) completion earns reward 1.

    Args:
        engine_or_model: an idle ``GenerationEngine``, or a causal LM (wrapped in a
            fresh engine of ``max_batch_size`` rows; the model is put in eval mode).
        tokenizer: encodes prompts (``ops.generate.encode_prompt``) and supplies EOS.
        task: provides ``reward(output_text, answer)`` and ``max_answer_tokens``
            (default 16 new tokens when absent).
        problems: dicts with ``"prompt"`` and ``"answer"``.
        chat_template: as ``ops.generate(chat_template=...)``; None = when the tokenizer
            has a chat template (what the rollout worker does by default).

    Returns:
        accuracy in ``[0, 1]``; ``0.0`` for an empty ``problems`` list.

    Raises:
        RuntimeError: the engine has requests in flight.
        ValueError: ``chat_template=True`` and the tokenizer has none.
    """
    if not problems:
        return 0.0
    engine = engine_or_model
    if not isinstance(engine, GenerationEngine):
        engine = GenerationEngine(engine_or_model, tokenizer, max_batch_size=max_batch_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=getattr(task, "max_answer_tokens", 16))
    requests = [GenerationRequest(f"eval-{i}", encode_prompt(tokenizer, p["prompt"], chat_template), params)
                for i, p in enumerate(problems)]
    with torch.inference_mode():
        results = engine.generate(requests)
    # output_text has special tokens removed: the text up to EOS is the whole text when it stopped.
    scores = [task.reward(r.output_text, p["answer"]) for r, p in zip(results, problems)]
    return sum(scores) / len(scores)
