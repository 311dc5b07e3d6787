"""One RL step of the parallel trainer against the single-process step: batch, reference, comparison.

Shared by ``test_parallel_rl.py`` (dp, tp) and ``test_parallel_rl_pp_cp_ep.py`` (pp, cp, ep).

Tolerances (the runs differ only in the order of fp32 additions: FSDP's reduce-scatter sums
two half-batch gradients, TP sums partial matmuls, the pipeline and expert parallelism sum a
tied matrix's or an expert's two partial gradients, Ulysses attention runs per head slice on
the whole sequence; fp32 unit roundoff is 6e-8):

- loss and per-token metrics: relative 1e-5 (sums of ~40 terms of size ~1: error ~40 x 6e-8).
- gradients: ``rtol 1e-4, atol 1e-7`` (|g| <= ~1e-1; observed worst difference ~1e-8 dp2, ~5e-8 tp2).
- weights after the first AdamW step: the update is ``lr * g / (|g| + eps)`` (bias-corrected
  m = g, v = g^2; Loshchilov & Hutter 2019, Alg. 2), whose slope in g is
  ``eps / (|g| + eps)^2``; so a gradient error of at most ``d`` moves a weight by at most
  ``lr * d * eps / (max(|g| - d, 0) + eps)^2`` (capped at ``2 lr``), plus rounding: 4 machine
  epsilons of ``|w| + lr`` (the few fp32 operations of the update, ~lr, and ``w - update``).
  That bound is checked element by element with ``d`` the observed gradient difference plus
  the gradient tolerance.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from areal_flow.algorithms.advantages import compute_advantages
from areal_flow.algorithms.catalog import ALGORITHMS
from areal_flow.algorithms.lookup import build_algorithm
from areal_flow.models.logprobs import token_logprobs
from areal_flow.models.tiny import build_model
from areal_flow.models.tokenizer import build_char_tokenizer
from runtime.executors.train_settings import TrainSettings
from runtime.model_source import load_pretrained
from runtime.parallel.weight_sync import full_named_tensors

LR, EPS = 1e-3, 1e-8  # EPS: torch.optim.AdamW's default, which the trainer uses
LOSS_RTOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-7
METRICS = ("loss", "policy_loss", "grad_norm", "entropy", "importance_weight_mean", "kl_behavior_current",
           "clip_frac", "importance_weight_max")
# decoupled PPO: behavior importance weights above 1.2 are masked, so with 0.3 nats of behavior
# noise some tokens are (AReaL eq. 5's cap, exercised); the proximal policy is recomputed
OVERRIDES = {"decoupled_ppo": {"behavior_imp_weight_cap": 1.2}}


def policy_folder(folder: Path, preset: str = "tiny-s") -> Path:
    """``folder`` holding a version-0 policy: tiny model ``preset`` (seed 0) and the character tokenizer."""
    tokenizer = build_char_tokenizer()
    build_model(preset, len(tokenizer), seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def settings(folder: Path, algorithm: str, packed: bool = False, **fields) -> TrainSettings:
    """The train_step settings every case shares (micro-batches of 2 sequences), ``fields`` changed."""
    loss = dataclasses.asdict(ALGORITHMS[algorithm].loss_config(OVERRIDES.get(algorithm, {})))  # as the plan has it
    return TrainSettings(**{**dict(model_folder=str(folder), algorithm=algorithm, loss=loss, lr=LR, weight_decay=0.01,
                                   max_grad_norm=1.0, micro_batch_size=2, temperature=1.0, seed=0,
                                   pack_sequences=packed), **fields})


def rl_batch(folder: Path) -> dict[str, torch.Tensor]:
    """2 groups x 4 samples. Rows 0-3 (dp rank 0) have responses of 1-4 tokens, rows 4-7 of
    3-6, so the step's token count (GRPO's token-mean) and longest response (Dr.GRPO's length)
    differ from either half's. Behavior log-probs are the policy's own plus
    noise of 0.3 nats, so some importance ratios leave the clip range [0.8, 1.2]."""
    generator = torch.Generator().manual_seed(3)
    lengths = [(3, 1), (3, 2), (4, 3), (2, 4), (3, 3), (5, 6), (2, 5), (4, 4)]  # (prompt, response) tokens
    width = max(p + r for p, r in lengths)
    input_ids = torch.zeros(8, width, dtype=torch.int64)
    attention_mask = torch.zeros(8, width, dtype=torch.int64)
    loss_mask = torch.zeros(8, width)
    for row, (p, r) in enumerate(lengths):
        input_ids[row, : p + r] = torch.randint(4, 50, (p + r,), generator=generator)
        attention_mask[row, : p + r] = 1
        loss_mask[row, p : p + r] = 1
    model, _ = load_pretrained(folder)
    with torch.no_grad():
        own = token_logprobs(model, input_ids, attention_mask)
    behavior = (own + 0.3 * torch.randn(own.shape, generator=generator)) * loss_mask
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    advantages = compute_advantages("grpo", rewards=rewards, group_ids=group_ids, loss_mask=loss_mask).advantages
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "behavior_logprobs": behavior, "advantages": advantages, "rewards": rewards, "group_ids": group_ids}


def single_process_step(folder: Path, batch: dict, algorithm: str) -> dict:
    """The reference: ``update_parameters`` on one process; stats, gradients, weights before and after."""
    torch.manual_seed(0)
    model, _ = load_pretrained(folder)
    model.train()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    spec = settings(folder, algorithm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    algo = build_algorithm(spec.algorithm, model, optimizer, loss_cfg=spec.loss_config(),
                           micro_batch_size=spec.micro_batch_size, max_grad_norm=spec.max_grad_norm,
                           temperature=spec.temperature)
    stats = algo.update_parameters(batch)
    grads = dict(full_named_tensors(model, grads=True))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"stats": stats, "grads": grads, "state": state, "initial": initial}


def assert_step_matches(got: dict, ref: dict, metrics: tuple[str, ...] = METRICS) -> None:
    """``got`` (stats, grads and gathered weights of the parallel step) equals ``ref`` within the
    module's tolerances; the weights within the Adam error bound."""
    assert got["stats"]["n_tokens"] == ref["stats"]["n_tokens"] == 28  # 1+2+3+4 + 3+6+5+4 response tokens
    assert got["stats"]["n_seqs"] == 8
    for key in metrics:
        assert got["stats"][key] == pytest.approx(ref["stats"][key], rel=LOSS_RTOL), key
    assert_update_matches(got, ref)


def assert_update_matches(got: dict, ref: dict) -> None:
    """``got``'s gradients (``grads``) equal ``ref``'s within the gradient tolerances, its
    weights after the AdamW step (``state``) ``ref``'s within the Adam error bound, and the
    reference step moved its weights (``initial``: before it)."""
    assert list(got["grads"]) == list(ref["grads"])  # tied lm_head.weight included, as in the state dict
    worst = {}
    for name, expected in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], expected, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   msg=lambda m: f"grad {name}: {m}")
        worst[name] = (got["grads"][name] - expected).abs() + GRAD_ATOL + GRAD_RTOL * expected.abs()
    # published weights: same names and order as the single-process state dict, within the Adam bound
    assert list(got["state"]) == list(ref["state"])
    for name, expected in ref["state"].items():
        g, d = ref["grads"][name].abs(), worst[name]
        bound = torch.clamp(LR * d * EPS / ((g - d).clamp(min=0) + EPS) ** 2, max=2 * LR)
        bound += 4 * torch.finfo(torch.float32).eps * (expected.abs() + LR)  # rounding of the update and of w - update
        excess = (got["state"][name] - expected).abs() - bound
        assert excess.max() <= 0, f"weight {name}: {excess.max():.3g} beyond the Adam error bound"
    # the step moved the weights: an element with |g| >> eps moves by about lr (times the clip factor)
    moved = max(float((ref["state"][n] - ref["initial"][n]).abs().max()) for n in ref["state"])
    assert moved > LR / 2
