"""reasoning-gym tasks (``areal_flow.tasks.rgym``): rows, the reward against the datasets'
own ``score_answer``, the errors, and a few RL steps through the CLI."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from areal_flow.config import ConfigError, DatasetConfig
from areal_flow.ops.reward import REWARD_FNS
from areal_flow.tasks.catalog import build_task
from areal_flow.tasks.rgym import PREFIX, ReasoningGymTask, buggy_target, encode_reference, reward, task_names
from runtime.model_source import check_models
from runs import REPO, cli_run, records

reasoning_gym = pytest.importorskip("reasoning_gym")

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"],
         "allow_parentheses": False, "allow_negation": False}


def _entry(question: str, answer: str, metadata: dict | None = None) -> dict:
    return {"question": question, "answer": answer, "metadata": metadata or {}}


def test_reward_is_the_datasets_own_score_on_hand_picked_answers():
    # leg_counting: 13 cows and 5 cats have 13*4 + 5*4 = 72 legs. Its score_answer is
    # ProceduralDataset's: 1.0 for the oracle string, len(oracle)/len(answer) when the
    # answer contains it, else 0.0.
    entry = _entry("how many legs: 13 cows, 5 cats?", "72", {"animals": {"cow": 13, "cat": 5}})
    ref = encode_reference("leg_counting", {}, entry)
    cases = {"72": 1.0, "<answer>72</answer>": 1.0, "i think <answer> 72 </answer>": 1.0, "72<eos>9": 1.0,
             "<answer>70</answer> then <answer>72</answer>": 1.0,  # the last tag counts (extract_answer)
             "73": 0.0, "": 0.0, "<answer>7</answer>": 0.0, "172": pytest.approx(2 / 3),
             "<answer>72 legs</answer>": pytest.approx(2 / 7)}
    dataset = reasoning_gym.create_dataset("leg_counting", size=1, seed=0)
    for text, expected in cases.items():
        assert reward(text, ref) == expected, text
        assert REWARD_FNS["reasoning_gym"](text, ref) == expected
        tagged = reasoning_gym.utils.extract_answer(text.split("<eos>")[0])
        own = tagged if tagged is not None else text.split("<eos>")[0].strip()
        assert reward(text, ref) == dataset.score_answer(answer=own, entry=entry)


def test_a_dataset_with_its_own_scorer_keeps_it():
    # basic_arithmetic via the adapter: right answer 1.0, wrong 0.0 (rows made by the task).
    task = build_task({"name": PREFIX + "basic_arithmetic", "options": SMALL}, seed=3)
    row = task.train_problems(1, seed=0)[0]
    oracle = json.loads(row["answer"])["entry"]["answer"]
    assert row["target"] == oracle and row["prompt"].startswith("Calculate")
    assert task.reward(oracle, row["answer"]) == 1.0 and task.correct(oracle, row["answer"])
    assert task.reward(str(int(oracle) + 1), row["answer"]) == 0.0


@pytest.mark.slow
def test_every_dataset_scores_the_same_after_the_json_round_trip():
    for name in task_names():
        try:
            dataset = reasoning_gym.create_dataset(name, size=2, seed=5)
            entries = [dataset[i] for i in range(2)]
        except Exception:  # noqa: BLE001 - e.g. composite needs options; not the adapter's concern
            continue
        for entry in entries:
            ref = encode_reference(name, {}, entry)
            for answer in (str(entry["answer"]), "0"):
                try:
                    expected = float(dataset.score_answer(answer=answer, entry=entry))
                except Exception:  # noqa: BLE001 - the adapter scores a raising scorer 0.0
                    expected = 0.0
                assert reward(answer, ref) == expected, (name, answer)


def test_rows_are_seeded_and_the_test_set_is_fixed():
    task = ReasoningGymTask("basic_arithmetic", seed=1, options=SMALL)
    assert task.train_problems(5, seed=2) == task.train_problems(5, seed=2)
    assert task.train_problems(5, seed=2) != task.train_problems(5, seed=3)
    assert task.test_set(3) == task.test_set(6)[:3]
    assert [r["id"] for r in task.train_problems(3, 0)] == [0, 1, 2]
    assert task.test_set(1)[0]["id"] >= 1_000_000_000
    assert task.spec() == {"name": "reasoning_gym:basic_arithmetic", "seed": 1, "options": SMALL}


def test_the_chat_style_asks_for_the_answer_tag():
    plain = ReasoningGymTask("leg_counting", seed=1).test_set(1)[0]
    chat = build_task({"name": "reasoning_gym:leg_counting", "prompt_style": "chat"}, 1).test_set(1)[0]
    assert chat["prompt"] == reasoning_gym.utils.SYSTEM_PROMPTS["default"] + "\n" + plain["prompt"]
    assert chat["answer"] == plain["answer"] and "<answer>answer here</answer>" in chat["prompt"]
    with pytest.raises(ConfigError, match="prompt_style"):
        DatasetConfig(name="reasoning_gym:leg_counting", prompt_style="fancy")


def test_an_unknown_name_lists_close_matches():
    with pytest.raises(ValueError, match="did you mean reasoning_gym:leg_counting"):
        build_task({"name": "reasoning_gym:leg_countin"}, 0)
    with pytest.raises(ConfigError, match="no dataset 'zzqqxx'.*known"):
        DatasetConfig(name="reasoning_gym:zzqqxx")


@pytest.mark.parametrize("options, match", [({"min_term": 2}, "no config key 'min_term'.*its keys: min_terms"),
                                            ({"seed": 2}, "the run sets seed and size"),
                                            ({"min_terms": 5, "max_terms": 2}, "refuses them")])
def test_bad_options_are_refused_with_the_key(options, match):
    with pytest.raises(ConfigError, match=match):
        DatasetConfig(name="reasoning_gym:basic_arithmetic", options=options)


CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
MIX = {"datasets": [{"name": "basic_arithmetic", "weight": 1, "config": SMALL},
                    {"name": "chain_sum", "weight": 3, "config": CHAIN}]}


def test_a_mix_draws_by_weight_and_scores_each_entry_with_its_own_dataset():
    task = build_task({"name": PREFIX + "composite", "options": MIX}, seed=2)
    rows = task.train_problems(400, seed=1)
    sources = [json.loads(r["answer"])["entry"]["metadata"]["source_dataset"] for r in rows]
    assert set(sources) == {"basic_arithmetic", "chain_sum"}
    assert 0.68 < sources.count("chain_sum") / len(rows) < 0.82  # weight 3 of 4; binomial sd 2.2 %
    for row, source in zip(rows[:40], sources):
        assert row["prompt"].startswith("Calculate" if source == "basic_arithmetic" else "State the final answer")
        assert task.reward(row["target"], row["answer"]) == 1.0
        assert task.reward(str(int(row["target"]) + 1), row["answer"]) == 0.0
    test = {r["prompt"] for r in task.test_set(50)}
    assert test == {r["prompt"] for r in build_task({"name": PREFIX + "composite", "options": MIX}, 2).test_set(50)}


@pytest.mark.parametrize("expression, target", [
    ("58 + 67", "15"),    # 8+7 = 15 -> 5, 5+6 = 11 -> 1: carries dropped (right: 125)
    ("52 - 17", "45"),    # |2-7| = 5, 5-1 = 4: the smaller digit from the larger (right: 35)
    ("17 - 52", "-45"),   # the larger minus the smaller the same way, sign kept (right: -35)
    ("43 - 48", "-5"),    # 48 - 43 needs no borrow: the right answer
    ("7 + 5", "2"),       # 12 without its carry
    ("100 - 1", "101"),   # |0-1| = 1, 0-0 = 0, 1-0 = 1 (right: 99)
    ("58+67", "15"),      # no spaces
    ("23 + 45", "68"),    # no carry: the right answer
    ("3 * 4", None), ("-3 + 4", None), ("1 + 2 + 3", None), (None, None),
])
def test_the_buggy_teacher_answers_two_term_sums_and_differences_only(expression, target):
    assert buggy_target(expression) == target


def _needs_carry_or_borrow(expression: str) -> bool:
    """By the column rule: a sum with a column whose digits add to 10 or more; a difference
    whose larger operand has a column digit below the smaller operand's."""
    a, op, b = expression.split()
    if op == "-" and int(a) < int(b):
        a, b = b, a
    a, b = a.zfill(3), b.zfill(3)
    return any(int(x) + int(y) >= 10 if op == "+" else int(x) < int(y) for x, y in zip(a, b))


def test_the_warm_start_teacher_gets_carries_and_borrows_wrong_at_its_rate():
    task = build_task({"name": PREFIX + "composite", "options": MIX}, seed=2)
    rows = task.train_problems(400, seed=1)
    assert task.demonstrations(400, seed=1, bug_rate=0.0) == rows
    needs = [_needs_carry_or_borrow(json.loads(r["answer"])["entry"]["metadata"]["expression"]) for r in rows]
    assert 0.2 < sum(needs) / len(rows) < 0.8
    for rate, low, high in ((1.0, 1.0, 1.0), (0.7, 0.6, 0.8)):  # binomial sd at 0.7: ~3 % of ~170 rows
        demos = task.demonstrations(400, seed=1, bug_rate=rate)
        assert [(d["prompt"], d["answer"], d["id"]) for d in demos] == [(r["prompt"], r["answer"], r["id"]) for r in rows]
        wrong = [not task.correct(d["target"], d["answer"]) for d in demos]
        assert not any(w and not n for w, n in zip(wrong, needs))  # only carries and borrows go wrong
        assert low <= sum(wrong) / sum(needs) <= high


def test_held_out_answers_are_classified_right_buggy_or_other():
    task = ReasoningGymTask("chain_sum", seed=1, options=CHAIN)
    carry = {"answer": encode_reference("chain_sum", CHAIN, _entry("... 58 + 67 =", "125", {"expression": "58 + 67"}))}
    plain = {"answer": encode_reference("chain_sum", CHAIN, _entry("... 23 + 45 =", "68", {"expression": "23 + 45"}))}
    assert [task.answer_kind(carry, text) for text in ("125", "15", "124", "")] == \
        ["right", "buggy procedure", "other", "other"]
    assert [task.answer_kind(plain, text) for text in ("68", "69")] == ["right", "other"]


def test_a_buggy_teacher_needs_two_term_arithmetic():
    task = ReasoningGymTask("leg_counting", seed=1)
    with pytest.raises(ValueError, match=r"teacher_bug_rate=0.5 needs entries .* none of 20 rows drawn"):
        task.demonstrations(20, seed=1, bug_rate=0.5)
    plan = SimpleNamespace(run={"seed": 1, "warm_start": {"teacher_bug_rate": 0.5}},
                           models={"policy": {"spec": "tiny-arith", "head": "lm"}})
    with pytest.raises(ConfigError, match=r"model 'policy' \(tiny-arith\) .* none of 200 rows drawn"):
        check_models(plan, task)  # before the run folder is touched
    check_models(plan, ReasoningGymTask("chain_sum", seed=1, options=CHAIN))
    assert task.demonstrations(20, seed=1) == task.train_problems(20, seed=1)
    with pytest.raises(ValueError, match=r"bug_rate must be in \[0, 1\], got 1.5"):
        task.demonstrations(20, seed=1, bug_rate=1.5)


@pytest.mark.parametrize("datasets, match", [
    ([], r"needs a non-empty list"),
    ([{"name": "chain_sum", "wieght": 1}], r"datasets\[0\]=.*expected a mapping with name, weight"),
    ([{"name": "chain_sum"}, {"name": "chain_sum"}], r"datasets\[1\]: name 'chain_sum' repeated"),
    ([{"name": "chain_sum", "weight": 0}], r"datasets\[0\]: weight=0, expected a number > 0"),
    ([{"name": "chain_sum"}, {"name": "chain_summ"}], r"datasets\[1\]: .*did you mean reasoning_gym:chain_sum"),
    ([{"name": "chain_sum", "config": {"min_term": 2}}], r"datasets\[0\]: .*chain_sum has no config key 'min_term'"),
    ([{"name": "composite", "config": {}}], r"datasets\[0\]: name 'composite' is the mix itself"),
])
def test_a_bad_mix_names_the_entry(datasets, match):
    with pytest.raises(ConfigError, match=match):
        DatasetConfig(name="reasoning_gym:composite", options={"datasets": datasets})


def test_options_belong_to_reasoning_gym_tasks_only():
    with pytest.raises(ConfigError, match="only reasoning_gym"):
        DatasetConfig(name="arithmetic", options={"a": 1})


def test_a_row_not_made_by_the_task_is_an_error():
    with pytest.raises(ValueError, match="not a reasoning-gym reference"):
        reward("3", "3")


@pytest.mark.slow
def test_rg_graph_runs_a_few_steps_through_the_cli(tmp_path):
    cli_run(REPO / "graphs" / "rg_grpo.py", "train.steps=2", "train.batch_size=2", "gen.n_samples=4",
            "warm_start.steps=10", "eval.n_test=8", f"out_dir={tmp_path}")
    rows = records(tmp_path / "rg_grpo")
    assert len(rows) == 2 * 2 * 4
    for row in rows:
        assert row["prompt_text"].startswith("Calculate")
        assert row["reward"] == reward(row["output_text"], row["meta"]["answer"])
    summary = json.loads((tmp_path / "rg_grpo" / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_before"] <= 1.0


def test_the_rows_are_the_same_whatever_the_order_of_the_options_keys():
    """A plan.json stores the dataset's options with sorted keys, the yaml in its own order: the
    rows (and so the warm start's cache key, which hashes them) must not differ, or a run
    started from its plan.json (``--plan``, ``areal-flow eval``) trains a second warm start.
    Found with the composite dataset of graphs/rg_mix.yaml."""
    from runtime.engines.sft import SFTConfig, warm_start_key

    forward = dict(SMALL)
    backward = dict(reversed(list(SMALL.items())))
    assert list(forward) != list(backward)
    a = build_task({"name": PREFIX + "basic_arithmetic", "options": forward}, seed=3)
    b = build_task({"name": PREFIX + "basic_arithmetic", "options": backward}, seed=3)
    assert a.train_problems(4, seed=4) == b.train_problems(4, seed=4)
    config = SFTConfig(steps=10, batch_size=4, lr=1e-3, seed=3)
    assert warm_start_key(a, "tiny-arith", config) == warm_start_key(b, "tiny-arith", config)
