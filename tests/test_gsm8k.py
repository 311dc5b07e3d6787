"""GSM8K loader and reference parsing, checked against lines of the shipped data read by hand."""

from __future__ import annotations

import json
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

pytest.importorskip("datasets", reason="GSM8K is read with the 'datasets' package (a dependency: pip install -e .)")

import areal_flow
from areal_flow.tasks.arithmetic import TEST_ID_OFFSET
from areal_flow.tasks.gsm8k import (
    GSM8KConfig,
    GSM8KTask,
    default_data_dir,
    load_gsm8k,
    parse_reference,
    read_gsm8k_jsonl,
)


def test_default_dir_is_shipped_in_the_package():
    folder = default_data_dir()
    package = Path(areal_flow.__file__).parent
    assert folder.parent.parent == package
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["LICENSE", "test.jsonl", "train.jsonl"]
    # pyproject's package-data carries every one of them into a wheel (pip install .)
    pyproject = tomllib.loads((package.parent / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["areal_flow"]
    assert all(any(fnmatch(f"data/gsm8k/{name}", g) for g in globs) for name in files)


def test_train_split_size_and_known_lines():
    problems = load_gsm8k(GSM8KConfig(split="train"))
    assert len(problems) == 7473  # GSM8K paper: 7,473 training problems
    # line 1: 48 clips in April, 48/2 = 24 in May, 48 + 24 = 72
    assert problems[0]["answer"] == "72" and problems[0]["prompt"].startswith("Natalia sold clips")
    assert problems[0]["id"] == 0
    # line 2: $12/h for 50 min = 12 * 50/60 = 10
    assert problems[1]["answer"] == "10"
    # line 645: 1,200,000 people/day * 13 weeks * 7 days = 109,200,000 ("#### 109,200,000")
    assert problems[644]["answer"] == "109200000" and problems[644]["id"] == 644
    # line 2584: 48 h/week / 4 courses = 12 h; 12 h * 4 weeks * $25 = 1,200 ("#### 1,200")
    assert problems[2583]["answer"] == "1200"
    # line 5716: (-14 - 8 + 1) / 3 = -7
    assert problems[5715]["answer"] == "-7"


def test_test_split_and_limit():
    problems = load_gsm8k(GSM8KConfig(split="test", limit=3))
    assert len(problems) == 3
    # Janet: 16 - 3 - 4 = 9 eggs * $2 = 18; robe: 2 + 2/2 = 3; Josh: 200,000 - 130,000 = 70,000 ("#### 70000")
    assert [p["answer"] for p in problems] == ["18", "3", "70000"]
    assert len(load_gsm8k(GSM8KConfig(split="test"))) == 1319  # GSM8K paper: 1,319 test problems


def test_path_override_file_and_folder(tmp_path):
    rows = [{"question": "q0", "answer": "work\n#### 1,234"}, {"question": "q1", "answer": "#### -5"}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    expected = [{"prompt": "q0", "answer": "1234", "id": 0}, {"prompt": "q1", "answer": "-5", "id": 1}]
    assert load_gsm8k(GSM8KConfig(path=str(tmp_path))) == expected
    assert read_gsm8k_jsonl(tmp_path / "train.jsonl") == expected


def test_parquet_file_and_folder(tmp_path):
    pyarrow = pytest.importorskip("pyarrow", reason="parquet needs pyarrow (a dependency of datasets)")
    import pyarrow.parquet as pq

    table = pyarrow.table({"question": ["a", "b"], "answer": ["#### 3", "x\n#### 4,000"]})
    pq.write_table(table, tmp_path / "train.parquet")
    pq.write_table(table.slice(1), tmp_path / "test.parquet")
    assert load_gsm8k(GSM8KConfig(path=str(tmp_path / "train.parquet"))) == [
        {"prompt": "a", "answer": "3", "id": 0}, {"prompt": "b", "answer": "4000", "id": 1}]
    task = GSM8KTask(path=str(tmp_path))
    assert task.test_set() == [{"prompt": "b", "answer": "4000", "id": TEST_ID_OFFSET}]


def test_hub_name_unavailable_offline_names_the_key(monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # never reach the network here
    monkeypatch.setenv("HF_DATASETS_CACHE", "/nonexistent-areal-flow-test")
    with pytest.raises(RuntimeError, match=r"dataset.path='nobody/no-such-gsm8k'.*hub") as info:
        load_gsm8k(GSM8KConfig(path="nobody/no-such-gsm8k"))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "answer, expected",
    [("a\n#### 72", "72"), ("#### 1,200", "1200"), ("#### -3", "-3"), ("####  2.5 ", "2.5"),
     ("x #### 1 y\n#### 9", "9")],  # the last marker counts
)
def test_parse_reference(answer, expected):
    assert parse_reference(answer) == expected


@pytest.mark.parametrize("answer", ["no marker 72", "#### seventy", "#### ", "#### 1 2"])
def test_parse_reference_rejects(answer):
    with pytest.raises(ValueError, match="here.jsonl:3"):
        parse_reference(answer, where="here.jsonl:3")


@pytest.mark.parametrize(
    "bad_line, message",
    [("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object"),
     ('{"question": "q"}', "'answer' missing"), ('{"question": "q", "answer": "no marker"}', "####")],
)
def test_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n\n" + bad_line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        read_gsm8k_jsonl(path)
    assert f"{path}:3" in str(info.value)  # line 3: after one good line and a blank one


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="dataset.split"):
        load_gsm8k(GSM8KConfig(split="validation"))
    with pytest.raises(FileNotFoundError, match="dataset.path=.*missing.jsonl"):
        load_gsm8k(GSM8KConfig(path=str(tmp_path / "missing.jsonl")))
    with pytest.raises(FileNotFoundError, match="holds none of test.jsonl"):
        load_gsm8k(GSM8KConfig(path=str(tmp_path), split="test"))


def test_task_train_draws_are_seeded_shuffles(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(5)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "t", "answer": "#### 9"}) + "\n")
    task = GSM8KTask(path=str(tmp_path), seed=1)
    draw = task.train_problems(12, seed=2)
    assert draw == GSM8KTask(path=str(tmp_path), seed=1).train_problems(12, seed=2)  # reproducible
    # 12 = two full epochs of the 5 problems + 2: each epoch is a permutation of ids 0..4
    assert sorted(p["id"] for p in draw[:5]) == sorted(p["id"] for p in draw[5:10]) == [0, 1, 2, 3, 4]
    assert all(p["answer"] == str(p["id"]) and p["prompt"] == f"q{p['id']}" for p in draw)
    draws = {tuple(p["id"] for p in GSM8KTask(path=str(tmp_path), seed=s).train_problems(5, seed=0)) for s in range(6)}
    assert len(draws) > 1  # the task seed changes the order (6 seeds all giving one of 120 orders: ~1e-10)
    # test ids are offset from training ids; a single train file finds test.jsonl beside it
    assert GSM8KTask(path=str(tmp_path / "train.jsonl")).test_set() == [
        {"prompt": "t", "answer": "9", "id": TEST_ID_OFFSET}]


def test_task_on_shipped_data():
    task = GSM8KTask()
    assert [p["answer"] for p in task.test_set(2)] == ["18", "3"]  # test lines 1-2 (see above)
    assert task.reward("She makes 9 * 2 = $18.\n#### 18", "18") == 1.0
    assert task.reward("#### 17", "18") == 0.0
    with pytest.raises(FileNotFoundError, match="dataset.path"):
        GSM8KTask(path="/nonexistent/gsm8k")
