"""Supervised warm start, its cache, and greedy evaluation."""

import json
import math

import pytest
import torch

from areal_flow.models.tiny import build_model
from areal_flow.models.tokenizer import build_char_tokenizer
from areal_flow.tasks.arithmetic import ArithmeticTask
from runtime.engines import sft
from runtime.evaluate import greedy_accuracy
from runtime.engines.generation import GenerationEngine
from runtime.engines.sft import SFTConfig, answer_loss, encode_examples, load_warm_start, warm_start

torch.set_num_threads(1)
TOK = build_char_tokenizer()


def test_encode_examples_masks_only_answer_and_eos():
    ids, attn, loss_mask = encode_examples(TOK, [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10-20=", "answer": "-10"}])
    # row 0: <bos> 1 + 2 = 3 <eos> (7 tokens) then 3 pads to the width of row 1: <bos> 1 0 - 2 0 = - 1 0 <eos> (11)
    assert ids[0].tolist() == [1, 5, 14, 6, 18, 7, 2, 0, 0, 0, 0]
    assert attn[0].tolist() == [1] * 7 + [0] * 4
    assert loss_mask[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    assert loss_mask[1].tolist() == [0] * 7 + [1] * 4


def test_answer_loss_of_uniform_model_is_log_vocab():
    model = build_model("tiny-s", len(TOK))
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()  # tied LM head -> all logits 0 -> uniform over 50 tokens
    ids, attn, loss_mask = encode_examples(TOK, [{"prompt": "1+2=", "answer": "3"}])
    assert answer_loss(model, ids, attn, loss_mask).item() == pytest.approx(math.log(50), abs=1e-5)  # ln 50 = 3.912


class _OneProblem:
    """A task with a single problem, so a few SFT steps memorise it."""

    max_answer_tokens = 4

    def spec(self):
        return {"name": "one"}

    def train_problems(self, n, seed):
        return [{"prompt": "12+34=", "answer": "46", "id": i} for i in range(n)]

    reward = staticmethod(ArithmeticTask.reward)


def test_warm_start_caches_and_learns(tmp_path, monkeypatch):
    cfg = SFTConfig(steps=60, batch_size=8, lr=1e-2, warmup_steps=5, n_problems=8)
    task = _OneProblem()
    folder = warm_start(task, "tiny-s", cfg, cache_dir=tmp_path)
    assert folder.parent == tmp_path / "sft" and folder.name == sft.warm_start_key(task, "tiny-s", cfg)
    stats = json.loads((folder / "sft_stats.json").read_text())
    assert stats["preset"] == "tiny-s" and stats["sft"]["steps"] == 60

    def boom(*args, **kwargs):
        raise AssertionError("retrained although cached")

    monkeypatch.setattr(sft, "train_sft", boom)
    assert warm_start(task, "tiny-s", cfg, cache_dir=tmp_path) == folder
    other = SFTConfig(steps=61, batch_size=8, lr=1e-2, warmup_steps=5, n_problems=8)
    assert sft.warm_start_key(task, "tiny-s", other) != folder.name

    class _Reworded(_OneProblem):  # same spec(), one text changed (e.g. an env's observation edited)
        def train_problems(self, n, seed):
            return [{"prompt": "12 + 34 =", "answer": "46", "id": i} for i in range(n)]

    assert sft.warm_start_key(_Reworded(), "tiny-s", cfg) != folder.name  # a stale warm start is not reused

    class _Dialogues(_OneProblem):  # scripted dialogues: their token layout is part of the key
        def train_problems(self, n, seed):
            return [{"prompt": "hi", "segments": [("hi", False), ("5", True)], "id": i} for i in range(n)]

    dialogue_key = sft.warm_start_key(_Dialogues(), "tiny-s", cfg)
    monkeypatch.setattr(sft, "LAYOUT_VERSION", sft.LAYOUT_VERSION + 1)
    assert sft.warm_start_key(_Dialogues(), "tiny-s", cfg) != dialogue_key
    assert sft.warm_start_key(task, "tiny-s", cfg) == folder.name  # prompt/answer rows have no dialogue layout
    monkeypatch.undo()

    model, tok = load_warm_start(folder)
    problems = [{"prompt": "12+34=", "answer": "46"}, {"prompt": "12+34=", "answer": "47"}]
    # memorised "46": right for the first, wrong for the second -> 1/2
    assert greedy_accuracy(model, tok, task, problems) == 0.5
    engine = GenerationEngine(model, tok, max_batch_size=1)
    assert greedy_accuracy(engine, tok, task, problems * 2) == 0.5
    assert greedy_accuracy(engine, tok, task, []) == 0.0


def test_unknown_preset_is_reported(tmp_path):
    with pytest.raises(ValueError, match="known presets"):
        warm_start(_OneProblem(), "nope", SFTConfig(steps=1), cache_dir=tmp_path)


@pytest.mark.slow
def test_default_warm_start_reaches_partial_competence(tmp_path):
    # Measured on an idle core: ~20 s, 31-32 % (see SFTConfig); the band leaves room for seeds/BLAS.
    task = ArithmeticTask(seed=0, max_digits=2)
    folder = warm_start(task, "tiny-s", SFTConfig(), cache_dir=tmp_path)
    model, tok = load_warm_start(folder)
    acc = greedy_accuracy(model, tok, task, task.test_set(500))
    assert 0.15 <= acc <= 0.5
