"""The imperfect teacher of the arithmetic warm start (ArithmeticTask.demonstrations)."""

import pytest

from areal_flow.tasks.arithmetic import ArithmeticTask, sum_without_carry


def test_sum_without_carry_by_hand():
    # 58+67: ones 8+7=15 -> 5, tens 5+6=11 -> 1  => 15 (true sum 125)
    assert sum_without_carry(58, 67) == 15
    # 5+7 = 12 -> 2; 99+1: ones 9+1=10 -> 0, tens 9+0 -> 9 => 90
    assert sum_without_carry(5, 7) == 2 and sum_without_carry(99, 1) == 90
    # no carry anywhere: the true sum
    assert sum_without_carry(23, 41) == 64 and sum_without_carry(0, 0) == 0


def test_demonstrations_drop_carries_only_on_carrying_additions():
    task = ArithmeticTask(seed=1, max_digits=2)
    exact = task.train_problems(300, seed=0)
    always = task.demonstrations(300, seed=0, carry_error=1.0)
    assert [p["prompt"] for p in always] == [p["prompt"] for p in exact]
    changed = 0
    for right, shown in zip(exact, always):
        a, b = (int(x) for x in right["prompt"][:-1].replace("-", "+").split("+"))
        if "+" in right["prompt"] and sum_without_carry(a, b) != a + b:
            assert shown["answer"] == str(sum_without_carry(a, b))
            changed += 1
        else:  # subtractions and additions without a carry keep the right answer
            assert shown["answer"] == right["answer"]
    assert changed > 0
    assert task.demonstrations(300, seed=0, carry_error=0.0) == exact


def test_demonstrations_reject_bad_rate():
    with pytest.raises(ValueError, match=r"carry_error must be in \[0, 1\]"):
        ArithmeticTask().demonstrations(3, seed=0, carry_error=1.5)
