"""Per-token log-probabilities of a causal LM: the one function both the generation
engine's tests and the trainer use, so behavior and recomputed log-probs agree.
"""

from __future__ import annotations

import torch


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probability of every token given the tokens before it.

    Args:
        model: a ``transformers`` causal LM.
        input_ids: ``[batch, seq]`` int64, right- or left-padded.
        attention_mask: ``[batch, seq]``, 1 on real tokens, 0 on padding; None for packed
            rows (``areal_flow.algorithms.micro_batches``): then ``position_ids`` restarting
            at 0 mark the sequences (``transformers``' SDPA path then builds a block-diagonal
            mask; ``areal_flow.models.packed_attention`` attends per sequence instead).
        position_ids: ``[batch, seq]``; default ``cumsum(attention_mask) - 1`` clamped
            at 0, so left padding does not shift positions.
        temperature: logits are divided by it before the softmax, matching the
            distribution the sampler drew from (the behavior policy).

    Returns:
        ``[batch, seq]`` float32: out[b, t] = log p(input_ids[b, t] | input_ids[b, :t]);
        out[:, 0] = 0 and padded positions hold meaningless values (mask them).

    Raises:
        ValueError: neither ``attention_mask`` nor ``position_ids`` given.
    """
    return logprobs_from_logits(model_logits(model, input_ids, attention_mask, position_ids), input_ids, temperature)


def model_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    logits_to_keep: int | torch.Tensor = 0,
) -> torch.Tensor:
    """The logits ``[batch, seq, vocab]`` (the model's dtype) of ``model`` on ``input_ids``;
    arguments and errors as :func:`token_logprobs`. ``logits_to_keep > 0``: only the last that
    many positions' logits, ``[batch, logits_to_keep, vocab]`` (the LM head runs on those alone;
    ``transformers``' causal-LM argument of that name); a 1-D index tensor: those positions'
    logits, ``[batch, len(logits_to_keep), vocab]``."""
    if attention_mask is None and position_ids is None:
        raise ValueError("token_logprobs: packed rows (attention_mask=None) need position_ids")
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    keep = {"logits_to_keep": logits_to_keep} if isinstance(logits_to_keep, torch.Tensor) or logits_to_keep else {}
    if attention_mask is None:  # packed (no KV cache: a scoring pass; transformers' own packed mask needs none)
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **keep).logits
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **keep).logits


def logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of every token of ``input_ids [batch, seq]`` under ``logits [batch, seq, vocab]``
    (position ``t`` predicts token ``t + 1``), divided by ``temperature``.

    Returns:
        ``[batch, seq]`` float32, laid out as :func:`token_logprobs` (``out[:, 0] = 0``).
    """
    logits = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:]
    # log_softmax(x)[y] = x[y] - logsumexp(x): avoids materialising the full log-softmax.
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    out = picked - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(out, (1, 0), value=0.0)
