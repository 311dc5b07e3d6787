"""Held-out evaluation: greedy accuracy of a policy on task problems."""

from __future__ import annotations

import torch

from areal_flow.ops.generate import encode_prompt
from runtime.engines.generation import GenerationEngine, GenerationRequest, SamplingParams


def greedy_answers(
    engine_or_model, tokenizer, task, problems: list[dict], max_batch_size: int = 128, chat_template: bool | None = None
) -> list[str]:
    """The greedy (temperature 0) completion text of every problem, in order, special
    tokens removed (so the text up to EOS is the whole text when generation stopped).

    Args:
        engine_or_model: an idle ``GenerationEngine``, or a causal LM (wrapped in a
            fresh engine of ``max_batch_size`` rows; the model is put in eval mode).
        tokenizer: encodes prompts (``ops.generate.encode_prompt``) and supplies EOS.
        task: its ``max_answer_tokens`` bounds the completion (16 new tokens when absent).
        problems: dicts with ``"prompt"``.
        chat_template: as ``ops.generate(chat_template=...)``; None = when the tokenizer
            has a chat template (what the rollout worker does by default).

    Raises:
        RuntimeError: the engine has requests in flight.
        ValueError: ``chat_template=True`` and the tokenizer has none.
    """
    if not problems:
        return []
    engine = engine_or_model
    if not isinstance(engine, GenerationEngine):
        engine = GenerationEngine(engine_or_model, tokenizer, max_batch_size=max_batch_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=getattr(task, "max_answer_tokens", 16))
    requests = [GenerationRequest(f"eval-{i}", encode_prompt(tokenizer, p["prompt"], chat_template), params)
                for i, p in enumerate(problems)]
    with torch.inference_mode():
        return [r.output_text for r in engine.generate(requests)]


def greedy_accuracy(
    engine_or_model, tokenizer, task, problems: list[dict], max_batch_size: int = 128, chat_template: bool | None = None
) -> float:
    """Fraction of ``problems`` whose greedy completion (``greedy_answers``, same
    arguments) earns ``task.reward(output_text, problem["answer"]) == 1``; ``0.0`` for an
    empty list. Raises as ``greedy_answers``."""
    return answer_accuracy(task, greedy_answers(engine_or_model, tokenizer, task, problems, max_batch_size,
                                                chat_template), problems)


def answer_accuracy(task, answers: list[str], problems: list[dict]) -> float:
    """Mean ``task.reward(answer, problem["answer"])`` over paired ``answers`` and
    ``problems``; ``0.0`` for empty lists."""
    scores = [task.reward(text, p["answer"]) for text, p in zip(answers, problems)]
    return sum(scores) / len(scores) if scores else 0.0
