"""Character tokenizer, tiny presets and the arithmetic task."""

import pytest
from transformers import AutoTokenizer

from areal_flow.models.tiny import PRESETS, build_model
from areal_flow.models.tokenizer import build_char_tokenizer, load_tokenizer
from areal_flow.tasks.arithmetic import TEST_ID_OFFSET, ArithmeticTask


def test_tokenizer_ids_by_hand():
    tok = build_char_tokenizer()
    # specials: pad 0, bos 1, eos 2, unk 3; then "0123456789" -> 4..13, "+" 14, "-" 15, "*" 16, "/" 17, "=" 18
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.encode("37+58=") == [1, 7, 11, 14, 9, 12, 18]
    assert tok.encode("-0", add_special_tokens=False) == [15, 4]
    assert tok.encode("#", add_special_tokens=False) == [3]  # outside the alphabet -> <unk>
    assert len(tok) == 50  # 4 specials + 10 digits + 10 symbols ("+-*/=()., ") + 26 letters


def test_tokenizer_round_trip_and_reload(tmp_path):
    tok = build_char_tokenizer()
    text = "12-345= -333 ok"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids + [tok.eos_token_id]) == "<bos>" + text + "<eos>"
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.encode(text) == ids
    assert again.decode(ids, skip_special_tokens=True) == text
    assert (again.pad_token_id, again.eos_token_id, again.padding_side) == (0, 2, "left")


def test_tokenizer_reloads_with_spaces_next_to_a_qwen2_model(tmp_path):
    # A warm-start folder holds the tiny Qwen2 model and the tokenizer; AutoTokenizer
    # (transformers 5) would read config.json's qwen2 type and drop the spaces.
    tok = build_char_tokenizer()
    build_model("tiny-s", len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    # by hand: bos 1; "o" 38, "r" 41, "d" 27, "e" 28, "r" 41, " " 23, "7" 11, "2" 6
    assert again.encode("order 72") == [1, 38, 41, 27, 28, 41, 23, 11, 6]
    assert (again.pad_token_id, again.eos_token_id, again.padding_side) == (0, 2, "left")


def test_presets_and_unknown_preset():
    model = build_model("tiny-arith", 50)
    n = sum(p.numel() for p in model.parameters())
    assert 0.8e6 < n < 3e6
    assert next(model.parameters()).dtype.is_floating_point and str(next(model.parameters()).dtype) == "torch.float32"
    with pytest.raises(ValueError, match="tiny-arith"):  # the message lists known presets
        build_model("huge", 50)
    assert "tiny-s" in PRESETS


def test_task_problems_are_deterministic_and_correct():
    task = ArithmeticTask(seed=3, max_digits=3)
    a = task.train_problems(200, seed=1)
    assert a == ArithmeticTask(seed=3, max_digits=3).train_problems(200, seed=1)
    assert a != task.train_problems(200, seed=2)
    assert [p["id"] for p in a] == list(range(200))
    negatives = 0
    for p in a:
        prompt = p["prompt"]
        assert prompt.endswith("=")
        op = "+" if "+" in prompt else "-"
        x, y = prompt[:-1].split(op)
        assert 1 <= len(x) <= 3 and 1 <= len(y) <= 3
        assert int(p["answer"]) == (int(x) + int(y) if op == "+" else int(x) - int(y))
        negatives += p["answer"].startswith("-")
    assert negatives > 0  # '-' with a larger right operand happens


def test_only_plus_and_validation():
    task = ArithmeticTask(seed=0, max_digits=1, ops="+")
    assert all("+" in p["prompt"] and len(p["prompt"]) == 4 for p in task.train_problems(50, seed=0, exclude_test=0))
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops="*")
    with pytest.raises(ValueError, match="max_digits"):
        ArithmeticTask(max_digits=0)


def test_test_set_is_fixed_and_held_out():
    task = ArithmeticTask(seed=0)
    test = task.test_set(500)
    task.train_problems(1000, seed=9)  # drawing training data must not move the test set
    assert ArithmeticTask(seed=0).test_set(500) == test
    assert ArithmeticTask(seed=1).test_set(500) != test
    assert task.test_set(100) == test[:100]
    assert len({p["prompt"] for p in test}) == 500
    assert test[0]["id"] == TEST_ID_OFFSET
    held = {p["prompt"] for p in test}
    assert not held & {p["prompt"] for p in task.train_problems(5000, seed=0)}


@pytest.mark.parametrize(
    "text, answer, expected",
    [
        ("95", "95", 1.0),
        ("  95 \n", "95", 1.0),  # stripped
        ("95<eos>", "95", 1.0),
        ("95<eos>17", "95", 1.0),  # text after EOS ignored
        ("-28", "-28", 1.0),
        ("28", "-28", 0.0),  # sign matters
        ("095", "95", 1.0),  # same integer value
        ("+95", "95", 1.0),
        ("9 5", "95", 0.0),
        ("95abc", "95", 0.0),
        ("", "95", 0.0),
        ("<eos>95", "95", 0.0),  # nothing before EOS
        ("--5", "-5", 0.0),
        ("9" * 5000, "9", 0.0),  # over-long, must not raise
        (None, "95", 0.0),
        ("95", "not a number", 0.0),
    ],
)
def test_reward_edge_cases(text, answer, expected):
    assert ArithmeticTask.reward(text, answer) == expected
