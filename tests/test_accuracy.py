"""The run's accuracy counts right answers as the task judges them, whatever their reward:
``Trajectory.correct`` set by the generator (the dataset task's ``correct``) or the
episode (env success, an agent's return), averaged by ``step_metrics``, shown on the
progress bar and in TensorBoard only when something was judged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import runtime.executors.generate as generate
from areal_flow.tasks.arithmetic import ArithmeticTask
from areal_flow.types import Trajectory
from runtime.engines.generation import GenerationResult
from runtime.executors.episode_runner import episode_correct
from runtime.metrics import RunLogger
from runtime.observe import step_metrics
from test_metrics import _scalars


class TextEngine:
    """Answers each request at once with the next of ``texts`` (one token per character)."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.pending, self.version, self.max_batch_size = list(texts), [], 0, 8

    def submit(self, request) -> None:
        self.pending.append(request)

    def has_work(self) -> bool:
        return bool(self.pending)

    def num_active(self) -> int:
        return len(self.pending)

    def step(self) -> list[GenerationResult]:
        out = []
        for r in self.pending:
            text = self.texts.pop(0)
            out.append(GenerationResult(r.request_id, r.prompt_ids, [5] * len(text), [-0.1] * len(text),
                                        [0] * len(text), "stop", text, r.meta))
        self.pending = []
        return out


def _plan(dataset: str):
    return SimpleNamespace(nodes=[SimpleNamespace(op="dataset", grain="source", attrs={"name": dataset})])


def _generate(monkeypatch, dataset: str, texts: list[str], problem: dict) -> list[Trajectory]:
    from areal_flow.models.tokenizer import build_char_tokenizer

    monkeypatch.setattr(generate, "build_engine", lambda node, ctx: TextEngine(texts))
    attrs = {"n_samples": len(texts), "max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0}
    gen = generate.GenerateExecutor(SimpleNamespace(attrs=attrs, name="generate"),
                                    SimpleNamespace(tokenizer=build_char_tokenizer(), plan=_plan(dataset)))
    gen.submit(0, 1, problem)
    ((_, _, trajectories),) = gen.step()
    return trajectories


def test_the_generator_marks_each_response_right_or_wrong_by_the_dataset_task(monkeypatch):
    texts = ["95", " 95", "59", "95 apples"]  # right, right (spaces are stripped), wrong, wrong
    trajectories = _generate(monkeypatch, "arithmetic", texts, {"prompt": "37+58=", "answer": "95", "id": 0})
    assert [t.correct for t in trajectories] == [True, True, False, False]
    # an env task judges no single response: unknown, not wrong
    trajectories = _generate(monkeypatch, "guess_number", ["7", "9"], {"prompt": "guess", "answer": "7", "id": 0})
    assert [t.correct for t in trajectories] == [None, None]


def test_an_episode_is_judged_by_its_env_success_or_the_agent_return():
    assert episode_correct({"success": 1.0, "turns": 3.0}, -0.3, agent=False) is True  # a penalized success
    assert episode_correct({"resolved": 0.0}, 0.9, agent=False) is False  # a rewarded failure
    assert episode_correct({"turns": 3.0}, 1.0, agent=False) is None  # the env reports no success
    assert episode_correct({}, 0.8, agent=True) is True and episode_correct({}, -0.1, agent=True) is False


def _traj(i: int, reward: float, correct: bool | None) -> Trajectory:
    return Trajectory(f"0:{i}", 0, [1, 2], [3, 4], [-0.1, -0.1], [0, 0], "stop", reward=reward, correct=correct)


def _batch(rewards: list[float]) -> dict:
    n = len(rewards)
    return {"rewards": torch.tensor(rewards), "attention_mask": torch.ones(n, 4), "loss_mask": torch.ones(n, 2)}


def test_step_accuracy_is_the_fraction_judged_right_not_of_rewards_of_one():
    rewards = [0.95, 0.9, -0.05, 0.8]  # a length penalty took 0.05 per token off rule rewards of 1, 1, 0, 1
    trajectories = [_traj(0, 0.95, True), _traj(1, 0.9, True), _traj(2, -0.05, False), _traj(3, 0.8, None)]
    metrics = step_metrics(0, {}, _batch(rewards), trajectories, train_s=1.0, wait_s=0.0)
    assert metrics["accuracy"] == pytest.approx(2 / 3)  # 2 right of the 3 judged; the unjudged one left out
    assert metrics["reward"] == pytest.approx(sum(rewards) / 4)
    unjudged = step_metrics(0, {}, _batch([1.0, 0.0]), [_traj(0, 1.0, None), _traj(1, 0.0, None)], 1.0, 0.0)
    assert "accuracy" not in unjudged  # nothing judged: no accuracy, rather than one read off the reward


def test_the_bar_and_tensorboard_show_accuracy_only_where_judged(tmp_path):
    logger = RunLogger(tmp_path, total_steps=2, show_progress=False)
    common = {"samples": 2, "staleness": [0, 0], "reward": 0.5, "staleness_mean": 0.0}
    logger.log_step({"step": 0, **common, "accuracy": 0.5})
    assert "acc=0.50" in logger.bar.postfix.split(", ")
    logger.log_step({"step": 1, **common})
    assert "acc=" not in logger.bar.postfix
    logger.close()
    assert _scalars(tmp_path)["rl/accuracy"] == [(0, 0.5)]


def test_the_tasks_that_judge_answers_agree_with_their_rewards():
    plain, chat = ArithmeticTask(), ArithmeticTask(prompt_style="chat")
    assert plain.correct(" 95<eos>7", "95") and not plain.correct("9 5", "95")
    # the chat style's math reward takes a stated sum; its accuracy must follow it, not the plain rule
    assert chat.correct("7 + 8 = 15", "15") and not plain.correct("7 + 8 = 15", "15")
    assert not chat.correct("7 + 8 = 16", "15")
    from areal_flow.tasks.gsm8k import GSM8KTask
    from areal_flow.tasks.longtail import LongTailTask

    assert GSM8KTask.correct("so the answer is 1,200.", "1200") and not GSM8KTask.correct("12", "1200")
    assert LongTailTask.correct("18 19 20", "18 19 20") and not LongTailTask.correct("18 19", "18 19 20")
