"""Train the arithmetic task's reward model (RM) on CPU, cached on disk like the warm start.

The RM (``areal_flow.models.reward_model.RewardModel``) learns P(answer is correct | prompt)
from (prompt, candidate answer) pairs: for every training problem the right answer
(label 1) and one wrong candidate (label 0), drawn uniformly among the kinds that differ
from the right answer: the teacher's buggy column procedure
(``areal_flow.tasks.arithmetic.buggy_answer``), the right answer +1 or -1, one digit
changed, two adjacent digits swapped. Classes are balanced, so the majority baseline is
50 %.

Loss: pointwise binary cross-entropy on the correctness label, as the outcome verifiers of
Cobbe et al. 2021 ("Training Verifiers to Solve Math Word Problems", §4). Not the pairwise
Bradley-Terry loss of Ouyang et al. 2022 eq. 1: that loss is invariant to a shift of all
scores, so its sigmoid is no calibrated probability and a 0.5 threshold means nothing.

A pair is tokenized exactly as the policy's trajectory reaches the trainer
(``areal_flow.batching.collate``): ``encode_prompt(tokenizer, prompt)`` + the answer's ids +
EOS, right-padded. This lives beside ``sft.py`` (not in ``areal_flow.models``) because it
owns a cache under ``areal_flow.cache.cache_root()``; the library never imports runtime.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
import xxhash

from areal_flow.cache import cache_root
from areal_flow.models.reward_model import RewardModel
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.ops.generate import encode_prompt
from areal_flow.tasks.arithmetic import buggy_answer
from runtime.engines.sft import fit_sampled_batches

STATS_FILE = "rm_stats.json"
_OPERATION = re.compile(r"(\d+)\s*([+-])\s*(\d+)")  # "37+58=" and "What is 37 + 58? ..."


@dataclass(frozen=True)
class RewardModelConfig:
    """RM training hyper-parameters (all part of the cache key).

    Not yet tuned to reach 90 %. Measured on ``ArithmeticTask(max_digits=2)``, 500 held-out
    problems, one thread of a loaded 2-core machine: 400 steps x 64 pairs (~65 s) from a
    fresh ``tiny-s`` gave 51.7 %, from the ``tiny-s`` default warm start 51.6 % (loss stays
    at ln 2). 1-digit sums from a fresh ``tiny-s`` do learn (loss 0.58 after 400 steps).

    Attributes:
        steps: optimizer steps.
        batch_size: (prompt, candidate) pairs per step.
        lr: peak AdamW learning rate; linear warmup over the first 10 % then cosine to 10 %.
        seed: seeds the problem draw, the candidates, the head init and the batch order.
        n_problems: training problems (``task.train_problems``); each gives 2 pairs.
    """

    steps: int = 400
    batch_size: int = 64
    lr: float = 1e-3
    seed: int = 0
    n_problems: int = 8000


def wrong_candidates(prompt: str, answer: str, rng: random.Random) -> dict[str, int]:
    """Near-miss wrong answers to one problem, by kind (each differs from ``answer``).

    Kinds: ``"buggy procedure"`` (when the prompt parses as ``a+b``/``a-b`` and the bug
    changes the result), ``"plus one"``, ``"minus one"``, ``"digit changed"`` (one digit
    of ``|answer|`` replaced at random, no new leading zero), ``"digits swapped"`` (two
    adjacent different digits, no new leading zero; absent when none exist).
    """
    right = int(answer)
    out = {"plus one": right + 1, "minus one": right - 1}
    match = _OPERATION.search(prompt)
    if match:
        bug = buggy_answer(int(match.group(1)), match.group(2), int(match.group(3)))
        if bug != right:
            out["buggy procedure"] = bug
    sign, digits = ("-" if right < 0 else ""), list(str(abs(right)))
    i = rng.randrange(len(digits))
    low = 1 if i == 0 and len(digits) > 1 else 0
    digits_changed = digits.copy()
    digits_changed[i] = rng.choice([d for d in "0123456789"[low:] if d != digits[i]])
    out["digit changed"] = int(sign + "".join(digits_changed))
    swaps = [j for j in range(len(digits) - 1) if digits[j] != digits[j + 1] and (j > 0 or digits[1] != "0")]
    if swaps:
        j = rng.choice(swaps)
        digits[j], digits[j + 1] = digits[j + 1], digits[j]
        out["digits swapped"] = int(sign + "".join(digits))
    return out


def labelled_candidates(problems: list[dict], seed: int) -> list[dict]:
    """Two pairs per problem: ``{"prompt", "answer", "label": 1.0, "kind": "right"}`` and one
    wrong candidate of a kind drawn uniformly from :func:`wrong_candidates` (label 0.0)."""
    rng = random.Random(f"reward-model-candidates:{seed}")
    out = []
    for p in problems:
        wrong = wrong_candidates(p["prompt"], p["answer"], rng)
        kind = rng.choice(sorted(wrong))
        out.append({"prompt": p["prompt"], "answer": p["answer"], "label": 1.0, "kind": "right"})
        out.append({"prompt": p["prompt"], "answer": str(wrong[kind]), "label": 0.0, "kind": kind})
    return out


def encode_candidates(tokenizer, pairs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``encode_prompt(prompt) + answer ids + [eos]`` rows (the trajectory layout).

    Returns:
        ``input_ids [N, T]`` int64 (pad id elsewhere), ``attention_mask [N, T]`` int64.
    """
    rows = [encode_prompt(tokenizer, p["prompt"]) + tokenizer.encode(p["answer"], add_special_tokens=False)
            + [tokenizer.eos_token_id] for p in pairs]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    return ids, attn


def reward_model_key(task, base_folder: str | Path, cfg: RewardModelConfig) -> str:
    """Hex xxhash64 of ``task.spec()``, the RM config and the base folder's ``config.json``
    and weight files (``*.safetensors``, ``*.bin``), so two warm starts of one architecture
    with different weights get different keys.

    Raises:
        FileNotFoundError: ``base_folder`` has no ``config.json``.
    """
    base = Path(base_folder)
    digest = xxhash.xxh64(json.dumps({"task": task.spec(), "rm": asdict(cfg)}, sort_keys=True).encode())
    for path in [base / "config.json", *sorted(base.glob("*.safetensors")), *sorted(base.glob("*.bin"))]:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def fit_reward_model(task, base_folder: str | Path, cfg: RewardModelConfig,
                     progress: bool = False) -> tuple[RewardModel, object, dict]:
    """Train an RM from the backbone in ``base_folder`` without touching the cache.

    Returns:
        ``(model, tokenizer, stats)``, model in eval mode; ``stats = {"seconds",
        "final_loss" (BCE nats/pair over the last 20 steps; None after 0 steps), "n_params"}``.
    """
    tokenizer = load_tokenizer(base_folder)
    model = RewardModel.from_backbone(base_folder, seed=cfg.seed)
    ids, attn = encode_candidates(tokenizer, pairs := labelled_candidates(
        task.train_problems(cfg.n_problems, seed=cfg.seed), cfg.seed))
    labels = torch.tensor([p["label"] for p in pairs])
    def loss(idx: torch.Tensor, width: int) -> torch.Tensor:
        scores = model(ids[idx, :width], attn[idx, :width])
        return torch.nn.functional.binary_cross_entropy_with_logits(scores, labels[idx])

    stats = fit_sampled_batches(model, loss, attn, steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr,
                                weight_decay=0.01, warmup_steps=max(1, cfg.steps // 10), seed=cfg.seed,
                                desc="reward model (cached after)", progress=progress)
    return model, tokenizer, stats


def train_reward_model(task, base_folder: str | Path, cfg: RewardModelConfig, progress: bool = False,
                       cache_dir: str | Path | None = None) -> Path:
    """Folder of the RM trained from ``base_folder``'s backbone for ``task``, trained on first use.

    The folder is ``<cache_dir or cache_root()>/reward_model/<reward_model_key(...)>/`` and
    holds the RM (``RewardModel.load``), the base tokenizer (``load_tokenizer``) and
    ``rm_stats.json``; it is written to a temporary sibling and renamed into place, so a
    concurrent reader never sees a half-written folder.

    Args:
        task: provides ``train_problems(n, seed)`` and ``spec()`` (``ArithmeticTask``).
        base_folder: a causal LM and its tokenizer in ``transformers`` format (usually the
            policy's warm start, ``runtime.engines.sft.warm_start``).
        cfg: the RM hyper-parameters.
        progress: show a tqdm bar of the steps when it trains.
        cache_dir: cache root; default ``cache_root()``.

    Raises:
        FileNotFoundError / OSError: ``base_folder`` holds no model or tokenizer.
    """
    folder = Path(cache_dir or cache_root()) / "reward_model" / reward_model_key(task, base_folder, cfg)
    if (folder / STATS_FILE).exists():
        return folder
    model, tokenizer, stats = fit_reward_model(task, base_folder, cfg, progress)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    transformers.utils.logging.disable_progress_bar()
    model.save(tmp)
    tokenizer.save_pretrained(tmp)
    stats.update({"task": task.spec(), "rm": asdict(cfg), "base_folder": str(base_folder)})
    (tmp / STATS_FILE).write_text(json.dumps(stats, indent=2))
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def heldout_candidates(task, n: int) -> list[dict]:
    """:func:`labelled_candidates` of ``task.test_set(n)``: 2n pairs, half right answers, on
    problems ``train_problems`` never draws (its default ``exclude_test=500`` covers n <= 500)."""
    return labelled_candidates(task.test_set(n), seed=-1)


@torch.no_grad()
def reward_model_accuracy(folder: str | Path, task, n: int = 500, batch_size: int = 256) -> float:
    """Fraction of held-out pairs the RM in ``folder`` classifies right at P(correct) = 0.5.

    Pairs: :func:`heldout_candidates` (``2 * n`` of them, so the majority baseline is 0.5).

    Raises:
        FileNotFoundError: ``folder`` is not an RM folder (from ``RewardModel.load``).
    """
    model, tokenizer = RewardModel.load(folder), load_tokenizer(folder)
    pairs = heldout_candidates(task, n)
    ids, attn = encode_candidates(tokenizer, pairs)
    labels = torch.tensor([p["label"] for p in pairs])
    correct = 0
    for lo in range(0, len(pairs), batch_size):
        prob = model.score_probability(ids[lo:lo + batch_size], attn[lo:lo + batch_size])
        correct += int(((prob > 0.5).float() == labels[lo:lo + batch_size]).sum())
    return correct / len(pairs)
