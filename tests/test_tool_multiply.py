"""The ``tool_multiply`` task: its rows, its teacher's dialogues played against the real
``python_math`` env (sandboxed Python), and the ``dataset.*`` checks. Expected values by hand."""

from __future__ import annotations

import pytest

from areal_flow.config import ConfigError, DatasetConfig
from areal_flow.envs import make_env
from areal_flow.models.presets import ALPHABET
from areal_flow.tasks.catalog import build_task
from areal_flow.tasks.tool_multiply import ToolMultiplyTask, direct_dialogue, tool_dialogue


def test_dialogues_by_hand():
    assert tool_dialogue(347, 29) == [("347*29=", False), ("python(print(347*29))", True), ("10063", False),
                                      ("10063", True)]
    assert direct_dialogue(12, 11) == [("12*11=", False), ("132", True)]


def test_the_teacher_dialogue_plays_as_written_against_the_env():
    # every observation of the script is what the sandboxed tool prints; the answer earns 1
    row = ToolMultiplyTask(seed=3).train_problems(1, seed=1)[0]
    env = make_env("python_math", row)
    (prompt, _), (call, _), (shown, _), (answer, _) = row["segments"]
    assert env.reset() == prompt
    obs, reward, done, info = env.step(call)
    assert obs == shown == str(row["a"] * row["b"]) and reward == 0.0 and not done and info["python_calls"] == 1
    obs, reward, done, info = env.step(answer)
    assert reward == 1.0 and done and info["success"] == 1
    assert all(set(text) <= set(ALPHABET) for text, *_ in row["segments"])


def test_rows_operands_and_held_out_set():
    task = ToolMultiplyTask(seed=1, max_digits=3)
    test = task.test_set(200)
    assert test[:50] == task.test_set(50) and len({r["prompt"] for r in test}) == 200
    train = task.train_problems(2000, seed=2)
    assert train == task.train_problems(2000, seed=2) != task.train_problems(2000, seed=3)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in task.test_set(500)}
    for row in train:
        assert 10 <= row["a"] <= 999 and 10 <= row["b"] <= 999 and row["answer"] == str(row["a"] * row["b"])
        assert row["prompt"] == f"{row['a']}*{row['b']}="
    # the digit count is drawn first: about half of the operands have 2 digits (binomial sd 1.1 %)
    two = sum(r["a"] < 100 for r in train) / len(train)
    assert 0.45 < two < 0.55
    longest = max(len(r["segments"][1][0]) for r in ToolMultiplyTask(max_digits=4).train_problems(500, 0))
    assert longest + 1 <= ToolMultiplyTask.max_answer_tokens


def test_demonstrations_follow_the_bug_rate():
    task = ToolMultiplyTask(seed=1)
    rows = task.demonstrations(2000, seed=1, bug_rate=0.3)
    direct = [r for r in rows if r["teacher"] == "direct"]
    assert 0.27 < len(direct) / len(rows) < 0.33  # binomial sd 1.0 %
    assert all(r["segments"] == direct_dialogue(r["a"], r["b"]) for r in direct)
    assert all(r["teacher"] == "tool" for r in task.demonstrations(50, seed=1, bug_rate=0.0))
    with pytest.raises(ValueError, match="bug_rate"):
        task.demonstrations(5, seed=1, bug_rate=1.5)


def test_build_task_and_dataset_checks():
    task = build_task({"name": "tool_multiply", "max_digits": 2}, seed=4)
    assert isinstance(task, ToolMultiplyTask) and task.spec()["max_digits"] == 2
    assert DatasetConfig(name="tool_multiply", max_digits=4).max_digits == 4
    for bad in (1, 5, True):
        with pytest.raises(ConfigError, match=r"dataset.max_digits=.*tool_multiply task takes an int in 2..4"):
            DatasetConfig(name="tool_multiply", max_digits=bad)
    with pytest.raises(ValueError, match="max_digits"):
        ToolMultiplyTask(max_digits=5)
