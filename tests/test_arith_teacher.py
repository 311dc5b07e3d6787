"""The imperfect teacher of the arithmetic warm start (ArithmeticTask.demonstrations)."""

import pytest

from areal_flow.tasks.arithmetic import ArithmeticTask, buggy_answer, smaller_from_larger, sum_without_carry


def test_sum_without_carry_by_hand():
    # 58+67: ones 8+7=15 -> 5, tens 5+6=11 -> 1  => 15 (true sum 125)
    assert sum_without_carry(58, 67) == 15
    # 5+7 = 12 -> 2; 99+1: ones 9+1=10 -> 0, tens 9+0 -> 9 => 90
    assert sum_without_carry(5, 7) == 2 and sum_without_carry(99, 1) == 90
    # no carry anywhere: the true sum
    assert sum_without_carry(23, 41) == 64 and sum_without_carry(0, 0) == 0


def test_smaller_from_larger_by_hand():
    # 52-17: ones |2-7| = 5, tens 5-1 = 4  => 45 (true difference 35)
    assert smaller_from_larger(52, 17) == 45
    # 40-8: ones |0-8| = 8, tens 4-0 = 4 => 48 (true 32); 30-30 = 0
    assert smaller_from_larger(40, 8) == 48 and smaller_from_larger(30, 30) == 0
    # no borrow anywhere: the true difference
    assert smaller_from_larger(87, 25) == 62 and smaller_from_larger(9, 4) == 5


def test_buggy_answer_by_hand():
    assert buggy_answer(58, "+", 67) == 15
    assert buggy_answer(52, "-", 17) == 45
    # a < b: the pupil subtracts the other way round and keeps the sign: 17-52 -> -(45)
    assert buggy_answer(17, "-", 52) == -45
    # 3-8: |3-8| = 5 with the sign kept, which is right (no borrow inside one column)
    assert buggy_answer(3, "-", 8) == -5
    assert buggy_answer(23, "+", 41) == 64


def test_demonstrations_bug_only_problems_that_carry_or_borrow():
    task = ArithmeticTask(seed=1, max_digits=2)
    exact = task.train_problems(300, seed=0)
    always = task.demonstrations(300, seed=0, bug_rate=1.0)
    assert [p["prompt"] for p in always] == [p["prompt"] for p in exact]
    changed = {"+": 0, "-": 0}
    for right, shown in zip(exact, always):
        op = "+" if "+" in right["prompt"] else "-"
        a, b = (int(x) for x in right["prompt"][:-1].split(op))
        wrong = (sum_without_carry(a, b) if op == "+"
                 else smaller_from_larger(a, b) if a >= b else -smaller_from_larger(b, a))
        if wrong != int(right["answer"]):
            assert shown["answer"] == str(wrong)
            changed[op] += 1
        else:  # problems with no carry or borrow keep the right answer
            assert shown["answer"] == right["answer"]
    assert changed["+"] > 0 and changed["-"] > 0
    assert task.demonstrations(300, seed=0, bug_rate=0.0) == exact


def test_demonstrations_bug_rate_is_a_fraction():
    task = ArithmeticTask(seed=1, max_digits=2)
    exact = task.train_problems(4000, seed=0)
    always = task.demonstrations(4000, seed=0, bug_rate=1.0)
    some = task.demonstrations(4000, seed=0, bug_rate=0.7)
    buggable = [i for i, (r, w) in enumerate(zip(exact, always)) if r["answer"] != w["answer"]]
    shown_bug = sum(some[i]["answer"] == always[i]["answer"] for i in buggable)
    # Binomial(n, 0.7): 4 standard deviations either side
    n = len(buggable)
    sd = (n * 0.7 * 0.3) ** 0.5
    assert abs(shown_bug - 0.7 * n) < 4 * sd


def test_demonstrations_reject_bad_rate():
    with pytest.raises(ValueError, match=r"bug_rate must be in \[0, 1\]"):
        ArithmeticTask().demonstrations(3, seed=0, bug_rate=1.5)


def test_answer_kind_by_hand():
    task = ArithmeticTask(seed=1, max_digits=2)
    carry = {"prompt": "58+67=", "answer": "125"}
    assert task.answer_kind(carry, "125") == "right"
    assert task.answer_kind(carry, "15") == "buggy procedure"
    assert task.answer_kind(carry, "135") == "other"
    borrow = {"prompt": "17-52=", "answer": "-35"}
    assert task.answer_kind(borrow, "-45") == "buggy procedure"
    assert task.answer_kind(borrow, "45") == "other"
    # no carry: the buggy procedure gives the right answer, so a wrong answer is "other"
    plain = {"prompt": "23+41=", "answer": "64"}
    assert task.answer_kind(plain, "64") == "right" and task.answer_kind(plain, "65") == "other"
    chat = ArithmeticTask(seed=1, max_digits=2, prompt_style="chat")
    question = {"prompt": "What is 58 + 67? Answer with just the number.", "answer": "125"}
    assert chat.answer_kind(question, "58 + 67 = 125") == "right"
    assert chat.answer_kind(question, "15") == "other"
