"""SmolLM2-135M through the runtime: chat-template prompt encoding, and behavior log-probs
of the embedded engine against ``token_logprobs`` recomputation (what the trainer does).

The engine decodes with its own KV cache and right-padded prefill; the trainer recomputes
on a padded batch with ``position_ids = cumsum(mask) - 1``. On fresh samples the PPO
importance ratio exp(recomputed - behavior) must be 1, so the log-probs must agree to well
under 1e-3 (measured here: max |diff| ~1e-5 in fp32) for left and right padding alike,
with prompts of different lengths in one batch.
"""

from __future__ import annotations


import pytest
from markers import needs_smollm2
import torch

from areal_flow.models.logprobs import token_logprobs
from areal_flow.models.tokenizer import build_char_tokenizer
from areal_flow.ops.generate import encode_prompt
from runtime.engines.generation import GenerationEngine, GenerationRequest, SamplingParams


QUESTIONS = [
    "What is 7 + 5? Answer with just the number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Hi",
]


@pytest.fixture(scope="module")
def smollm2():
    from areal_flow.models.hf import load_model

    torch.set_num_threads(1)
    return load_model("smollm2-135m")


def test_encode_prompt_without_chat_template_is_plain_encode():
    tok = build_char_tokenizer()  # no chat template
    # auto and False: <bos> (id 1) + 4 special ids + position in ALPHABET: "1" -> 4 + 1 = 5,
    # "=" -> 4 + 14 = 18 (10 digits, then "+-*/=")
    assert encode_prompt(tok, "1=") == encode_prompt(tok, "1=", chat_template=False) == [1, 5, 18]
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(tok, "1=", chat_template=True)


def test_arithmetic_chat_style_same_problems_as_questions_with_math_reward():
    from areal_flow.tasks.arithmetic import ArithmeticTask

    plain, chat = ArithmeticTask(seed=4, max_digits=2), ArithmeticTask(seed=4, max_digits=2, prompt_style="chat")
    for p, c in zip(plain.test_set(20), chat.test_set(20)):
        a, op, b = p["prompt"][:-1].partition("+") if "+" in p["prompt"] else p["prompt"][:-1].partition("-")
        assert c["prompt"] == f"What is {a} {op} {b}? Answer with just the number."
        assert c["answer"] == p["answer"] and c["id"] == p["id"]
    # the final number counts for chat replies; the plain task wants the bare integer
    assert chat.reward("37 + 58 = 95", "95") == 1.0 and chat.reward("37 + 58 = 170", "95") == 0.0
    assert plain.reward("37 + 58 = 95", "95") == 0.0 and plain.reward("95", "95") == 1.0
    assert chat.max_answer_tokens == ArithmeticTask.CHAT_ANSWER_TOKENS and plain.max_answer_tokens == 2 + 3
    assert "prompt_style" not in plain.spec() and chat.spec()["prompt_style"] == "chat"
    with pytest.raises(ValueError, match="prompt_style"):
        ArithmeticTask(prompt_style="markdown")


@needs_smollm2
@pytest.mark.slow
def test_encode_prompt_applies_smollm2_chat_template(smollm2):
    _, tok = smollm2
    ids = encode_prompt(tok, "Hi")
    # ChatML: default system turn, the user turn, an open assistant turn; no special token added twice
    assert tok.decode(ids) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                               "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert encode_prompt(tok, "Hi", chat_template=False) == tok.encode("Hi")


@needs_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_behavior_logprobs_match_recomputation_on_smollm2(smollm2, padding_side):
    model, tok = smollm2
    temp = 0.8
    prompts = [encode_prompt(tok, q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == 3  # three different prompt lengths in one batch
    engine = GenerationEngine(model, tok, max_batch_size=4, seed=0)
    params = SamplingParams(temperature=temp, max_new_tokens=12, stop_at_eos=False)
    results = engine.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    seqs = [r.prompt_ids + r.output_ids for r in results]
    width = max(map(len, seqs))
    pad = tok.pad_token_id
    rows, masks = [], []
    for s in seqs:
        fill = width - len(s)
        rows.append([pad] * fill + s if padding_side == "left" else s + [pad] * fill)
        masks.append([0] * fill + [1] * len(s) if padding_side == "left" else [1] * len(s) + [0] * fill)
    with torch.no_grad():
        ref = token_logprobs(model, torch.tensor(rows), torch.tensor(masks), temperature=temp)
    worst = 0.0
    for b, r in enumerate(results):
        start = width - len(seqs[b]) if padding_side == "left" else 0
        resp = ref[b, start + len(r.prompt_ids): start + len(seqs[b])]
        worst = max(worst, (resp - torch.tensor(r.behavior_logprobs)).abs().max().item())
    # |exp(d) - 1| <= 1e-3 needs |d| < ~1e-3; fp32 keeps it orders of magnitude below
    assert worst < 2e-4, f"max |behavior - recomputed| = {worst:.2e}"
