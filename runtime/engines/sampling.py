"""Token sampling for the embedded engine: temperature, nucleus (top-p) truncation and the
behavior log-prob of the drawn token, for a batch of rows in a few tensor ops.

Owns only the draw; the engine decides what the rows are.
"""

from __future__ import annotations

import torch

_BLOCK = 256
"""Vocabulary block of the two-level inverse-CDF draw (see ``_draw``)."""


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """``[R, 1]`` index of the last positive entry of each row of ``x [R, N]``. A draw can
    land past it only when ``u * total`` rounds up to ``total``; clamping there keeps
    zero-probability entries (top-p cut, padding) from ever being drawn."""
    return (x > 0).long().cumsum(-1).argmax(-1, keepdim=True)


def _draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One index per row of ``probs [R, V]`` (non-negative, rows need not sum to 1), drawn
    with probability proportional to the entries.

    Inverse-CDF sampling (Devroye 1986, ch. II.2) in two levels: first a block of
    ``_BLOCK`` entries by the cumulative block masses, then an entry inside it. One
    uniform number per level and row instead of one exponential per entry (what
    ``torch.multinomial`` draws). Two levels keep fp32 rounding small: a flat fp32 cumsum
    over 49,152 entries would shift each entry's share by up to one ulp of the running
    sum (6e-8); here the shift is one ulp of a block mass, scaled by that mass.
    """
    rows, vocab = probs.shape
    pad = (-vocab) % _BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(rows, -1, _BLOCK)
    mass = blocks.sum(-1)  # [R, nb]
    cum = mass.cumsum(-1)
    u = torch.rand(rows, 1, generator=gen, device=probs.device, dtype=probs.dtype)
    b = torch.searchsorted(cum, u * cum[:, -1:], right=True)
    b = torch.minimum(b, _last_positive(mass))
    inner = blocks.gather(1, b[:, :, None].expand(rows, 1, _BLOCK)).squeeze(1)  # [R, BLOCK]
    icum = inner.cumsum(-1)
    u2 = torch.rand(rows, 1, generator=gen, device=probs.device, dtype=probs.dtype)
    j = torch.searchsorted(icum, u2 * icum[:, -1:], right=True)
    j = torch.minimum(j, _last_positive(inner))
    return (b * _BLOCK + j).squeeze(-1)


def sample(logits: torch.Tensor, temps: torch.Tensor, top_p: torch.Tensor, gen: torch.Generator, kernels=None):
    """Draw one token per row of ``logits [R, vocab]`` (fp32).

    Args:
        logits: ``[R, vocab]`` fp32.
        temps: ``[R]`` temperatures; ``0`` means greedy (argmax).
        top_p: ``[R]`` nucleus mass in ``(0, 1]`` (Holtzman et al. 2020, sec. 3.1): the
            smallest set of most likely tokens whose mass reaches ``top_p`` is kept.
        gen: the engine's random generator.
        kernels: ``torch.ops.areal_flow`` (``runtime.engines.cpu_kernels``) or None. Given, CPU
            logits and no row with ``top_p < 1``: the same draw by its ``sample`` kernel (two passes
            a row, ``csrc/sampling.cpp``), from the same two uniforms a row taken from ``gen`` in the
            same order, so the generator advances alike; its sums run in another order, so a draw
            can differ where a uniform falls within rounding of a block or entry boundary.

    Returns:
        ``(ids [R] int64, logprobs [R] fp32)``: the behavior log-prob is
        ``log_softmax(logits / T)[id]``, untruncated by top-p (what the trainer recomputes;
        see ``GenerationResult``), at ``T = 1`` for greedy rows.

    One exponential per vocabulary entry: the draw takes ``exp(x - max x)`` unnormalised and
    the log-prob is ``x_id - max x - log sum exp(x - max x)``, instead of a ``log_softmax``
    pass and an ``exp`` pass over it. Measured on this CPU, one thread, SmolLM2's ``[64, 49152]``
    fp32 logits fresh from a decode step: 10.4 -> 9.1 ms a draw; log-prob error against a
    float64 ``log_softmax`` 4.7e-7 (``log_softmax`` in fp32: 4.4e-6).
    """
    greedy = temps == 0
    if kernels is not None and logits.device.type == "cpu" and not bool((top_p < 1).any()):
        rows = logits.shape[0]
        if bool(greedy.all()):
            u = torch.zeros(rows, 2)
        else:  # as _draw takes them: the block's uniform for every row, then the entry's
            u = torch.cat([torch.rand(rows, 1, generator=gen), torch.rand(rows, 1, generator=gen)], dim=1)
        return kernels.sample(logits.contiguous(), temps, u)
    scaled = logits if bool((temps == 1).all()) else logits / torch.where(greedy, 1.0, temps)[:, None]
    # log_softmax(x)[i] = x[i] - max(x) - log(sum(exp(x - max(x)))): one exp pass gives both the
    # unnormalised probabilities the draw needs and the normaliser of the log-prob.
    peak, best = scaled.max(dim=-1, keepdim=True)  # greedy rows: argmax of logits / 1
    weights = (scaled - peak).exp_()  # [R, vocab], proportional to softmax(scaled), max entry 1
    total = weights.sum(-1, keepdim=True)
    ids = best.squeeze(-1)
    if not bool(greedy.all()):
        if bool((top_p < 1).any()):
            sorted_w, order = weights.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p: drop a token when the
            # mass strictly before it already reaches top_p (the first is always kept).
            drop = (sorted_w.cumsum(-1) - sorted_w) >= top_p[:, None] * total
            weights = torch.zeros_like(weights).scatter(-1, order, sorted_w.masked_fill(drop, 0.0))
        drawn = _draw(weights, gen)
        ids = torch.where(greedy, ids, drawn)
    return ids, (scaled.gather(-1, ids[:, None]) - peak - total.log()).squeeze(-1)
