"""math_reward on hand-written outputs: answer formats, normalization traps, and garbage."""

from __future__ import annotations

import threading
from fractions import Fraction

import pytest

from areal_flow.rewards.math import extract_answer, math_reward, parse_number

# (model output, reference, expected reward); each expected value is decided by reading the
# output as a grader would.
CASES = [
    # GSM8K marker
    ("48/2 = 24 in May. 48 + 24 = 72\n#### 72", "72", 1.0),
    ("#### 71", "72", 0.0),
    ("####72", "72", 1.0),
    ("#### 72 clips", "72", 1.0),
    ("#### $18.00", "18", 1.0),
    ("#### 1,200", "1200", 1.0),
    ("#### -7", "-7", 1.0),
    ("#### 7", "-7", 0.0),  # sign matters
    ("first try #### 5\nno wait\n#### 6", "6", 1.0),  # the last marker counts
    ("#### 42\nHope this helps! I also like 7 cats.", "42", 1.0),  # marker beats trailing numbers
    ("####\nThe answer is 9.", "9", 1.0),  # empty marker falls through to the phrase
    # \boxed
    ("So the total is \\boxed{72}.", "72", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # nested braces, 1/2 = 0.5
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{1\\frac{1}{2}}", "1.5", 1.0),  # mixed number 1 + 1/2 = 1.5
    ("\\boxed{18\\text{ dollars}}", "18", 1.0),
    ("\\boxed{\\$1{,}000}", "1000", 1.0),  # LaTeX thousands separator
    ("try \\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box counts
    ("\\boxed{3} then \\boxed{4}", "3", 0.0),
    ("\\boxed{}", "0", 0.0),
    ("\\boxed{2\\sqrt{2}}", "2", 0.0),  # 2*sqrt(2) = 2.83 != 2
    # answer phrases
    ("The answer is 42.", "42", 1.0),
    ("The answer is 42. I checked 6 * 7 = 42 and 40 + 2 = 42.", "42", 1.0),
    ("The final answer is: $1,234.50 dollars.", "1234.5", 1.0),
    ("Answer: 3.50", "3.5", 1.0),  # 3.50 = 3.5
    ("Answer: 3.05", "3.5", 0.0),
    ("the answer is **16** eggs", "16", 1.0),
    ("The answer is $\\frac{3}{4}$.", "0.75", 1.0),
    ("The answer is 1/2", "0.5", 1.0),  # 1/2 = 0.5 exactly
    ("The answer is 0.5", "1/2", 1.0),
    ("The answer is 0.33", "1/3", 0.0),  # exact comparison, no rounding
    ("answer = -$5", "-5", 1.0),
    ("The answer is \u221212", "-12", 1.0),  # Unicode minus sign
    ("The answer is 25%.", "25", 1.0),  # GSM8K writes percentages as the bare number
    ("The answer is 7 hours.\nLater: 3 hours passed.", "7", 1.0),
    ("the answer is 5 then, but the answer is 6", "6", 1.0),  # the last phrase counts
    ("She answered 5 questions and got 3 right.", "3", 1.0),  # "answered" is no answer phrase
    # last-number fallback
    ("She sold 48 + 24 = 72 clips.", "72", 1.0),
    ("She sold 48 + 24 = 72 clips. Wait, 72 - 2 = 70", "70", 1.0),
    ("8-5=3", "3", 1.0),  # "-5" after a digit is subtraction, not a sign
    ("It is worth $80,000.", "80000", 1.0),
    ("It is worth 80,000", "80", 0.0),  # thousands comma is not a decimal point
    ("from 12,34", "34", 1.0),  # "12,34" is not a thousands grouping: two numbers
    ("We get .5 of it", "0.5", 1.0),
    ("Total = 100000000000000000000", "100000000000000000000", 1.0),
    ("Total = 100000000000000000000", "100000000000000000001", 0.0),  # no float rounding
    ("Total = 1,000,000,000,000,000,000,000", "1000000000000000000000", 1.0),
    ("It costs 3.0 dollars", "3", 1.0),
    # garbage
    ("", "1", 0.0),
    ("   \n\t", "1", 0.0),
    ("None", "1", 0.0),
    ("I don't know.", "1", 0.0),
    ("nan inf NaN", "1", 0.0),
    ("\x00\ufffd\ufffd<|im_end|>", "1", 0.0),
    ("9" * 5000, "9", 0.0),  # beyond int()'s 4300-digit limit: no answer, no exception
    ("\\boxed{\\frac{1}{", "0.5", 0.0),  # unclosed box is ignored; last number 1 != 1/2
    ("#### 1/0", "0", 0.0),  # division by zero is no answer
    ("{{{{}}}}\\boxed{\\boxed{\\boxed{", "0", 0.0),
]


@pytest.mark.parametrize("output, reference, expected", CASES)
def test_math_reward(output, reference, expected):
    assert math_reward(output, reference) == expected


def test_case_count():
    assert len(CASES) >= 40


@pytest.mark.parametrize("output", [None, 42, b"#### 42", ["#### 42"], float("nan")])
def test_non_text_output_scores_zero(output):
    assert math_reward(output, "42") == 0.0


@pytest.mark.parametrize("reference, output", [(72, "#### 72"), (0.5, "1/2"), (Fraction(1, 3), "\\boxed{\\frac{1}{3}}"),
                                               ("\\frac{1}{2}", "The answer is 0.5")])
def test_reference_types(reference, output):
    assert math_reward(output, reference) == 1.0


@pytest.mark.parametrize("reference", ["", "seventy", None, float("inf"), True])
def test_bad_reference_raises(reference):
    with pytest.raises(ValueError, match="reference answer"):
        math_reward("#### 1", reference)


@pytest.mark.parametrize(
    "text, value",
    [("1,234.50", Fraction(246900, 200)), ("-$5", -5), ("$-5", -5), ("3/4", Fraction(3, 4)), ("72 clips", 72),
     ("25%", 25), ("18\\text{ dollars}", 18), ("1{,}000", 1000), ("42.", 42), ("3 and 4", None), ("", None),
     ("\\frac{1}{2}", None)],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_extract_answer_priorities():
    # marker > boxed > phrase > last number
    assert extract_answer("\\boxed{1} The answer is 2. #### 3 and 4") == 3
    assert extract_answer("The answer is 2. \\boxed{1} 5") == 1
    assert extract_answer("The answer is 2. then 5") == 2
    assert extract_answer("then 5 and 6") == 6
    assert extract_answer("no digits") is None


def test_works_off_the_main_thread():
    # math-verify's timeout uses SIGALRM (main thread only); off it the timeout is disabled
    results = []
    worker = threading.Thread(target=lambda: results.append(math_reward("\\boxed{\\frac{1}{2}}", "0.5")))
    worker.start()
    worker.join()
    assert results == [1.0]


@pytest.mark.parametrize(
    "output, expected",
    [("\\boxed{" * 20_000, 0.0), ("1," * 50_000, 0.0), ("The answer is \\frac{" * 5_000, 0.0),
     ("{" * 100_000 + "\\boxed{7", 1.0),  # unclosed box ignored, last number 7 = 7
     ("-" * 100_000, 0.0)],
)
def test_pathological_outputs_are_fast(output, expected):
    import time

    start = time.perf_counter()
    assert math_reward(output, "7") == expected
    # seconds: a guard against super-linear extraction (quadratic on 100k chars takes minutes), not a speed
    # target; 10 s leaves room for a loaded 2-core machine (it failed at 2 s under load average 10)
    assert time.perf_counter() - start < 10.0


def test_a_math_verify_failure_is_a_failed_sample_not_a_zero(monkeypatch):
    """Issue 26: math-verify raising while comparing two parsed values used to score 0 (a
    right answer could be trained as wrong); now the pool counts the sample as failed."""
    import areal_flow.rewards.math as m
    from areal_flow.rewards.pool import RewardPool

    def broken(*args, **kwargs):
        raise RuntimeError("sympy blew up")

    monkeypatch.setattr(m, "_mv_verify", broken)
    with pytest.raises(m.MathVerifyError, match="sympy blew up"):
        math_reward(r"so \boxed{\sqrt{2}}", r"\sqrt{2}")  # LaTeX on both sides: math-verify compares
    assert math_reward("so 7", "7") == 1.0  # plain numbers never reach math-verify
    outcome, = RewardPool(math_reward, workers=1).map([(r"\boxed{\sqrt{2}}", r"\sqrt{2}")])
    assert outcome.failed and outcome.kind == "MathVerifyError" and outcome.value is None


@pytest.mark.parametrize("error", [RuntimeError("latex2sympy bug"), "timeout"])
def test_a_math_verify_parse_failure_is_a_failed_sample_naming_reference_and_output(monkeypatch, error):
    """Issue 26: math-verify raising or timing out while parsing the output's LaTeX used to be
    "no answer" (0); the reward is unknown, so it is a failed sample counted by the pool."""
    import areal_flow.rewards.math as m
    from areal_flow.rewards.pool import RewardPool

    def broken(*args, **kwargs):
        if error == "timeout":
            raise m._MathVerifyTimeout("took too long")
        raise error

    monkeypatch.setattr(m, "_mv_parse", broken)
    output = "x" * 100 + r" so \boxed{\sqrt{2}}"  # \sqrt is LaTeX only math-verify reads
    kind = "TimeoutException" if error == "timeout" else "RuntimeError"
    # the message names the reference and the output's last 60 characters (not the first 100 x's)
    tail = output[-60:]
    assert tail.startswith("x") and len(tail) == 60
    with pytest.raises(m.MathVerifyError) as info:
        math_reward(output, "7")
    assert str(info.value).startswith(f"reference '7', output ending {tail!r}: math_verify.parse raised {kind}")
    assert math_reward("#### 7", "7") == 1.0  # plain numbers never reach math-verify
    outcome, = RewardPool(math_reward, workers=1).map([(output, "7")])
    assert outcome.failed and outcome.kind == "MathVerifyError" and outcome.value is None
