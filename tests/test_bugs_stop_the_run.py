"""Issue 26: a programming error (``runtime.executors.bugs``) in the engine, an env or an
agent stops the run with one line naming the node; a refused request or an env's own
failure still fails one sample only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from areal_flow.envs import BaseEnv
from runtime.engines.generation import RequestRefused, SamplingParams
from runtime.executors.bugs import ProgrammingError, is_programming_error
from runtime.executors.episode_runner import EpisodeRunner
from test_rollout import ATTRS, TOK, FakeEngine, _drain


def test_the_split_between_bugs_and_failed_samples():
    for bug in (TypeError(), AttributeError(), NameError(), UnboundLocalError(), AssertionError(), ImportError(),
                ModuleNotFoundError(), NotImplementedError(), SyntaxError()):
        assert is_programming_error(bug), bug
    for failure in (RequestRefused(), ValueError(), KeyError(), IndexError(), RuntimeError(), OSError(),
                    TimeoutError(), ConnectionError(), ZeroDivisionError()):
        assert not is_programming_error(failure), failure


class _BrokenEngine(FakeEngine):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def submit(self, request) -> None:
        raise self.error


def _generate(monkeypatch, engine):
    import runtime.executors.generate as generate

    monkeypatch.setattr(generate, "build_engine", lambda node, ctx: engine)
    attrs = dict(n_samples=2, temperature=1.0, top_p=1.0, max_new_tokens=3, chat_template=False)
    return generate.GenerateExecutor(SimpleNamespace(name="generate", attrs=attrs), SimpleNamespace(tokenizer=TOK))


def test_a_bug_in_the_engine_stops_generation_with_one_line_naming_the_node(monkeypatch):
    gen = _generate(monkeypatch, _BrokenEngine(AttributeError("'NoneType' object has no attribute 'kv'")))
    with pytest.raises(ProgrammingError) as info:
        gen.submit(0, 1, {"prompt": "1+1=", "answer": "2", "id": "a"})
    message = str(info.value)
    assert "\n" not in message and info.value.brief
    assert message.startswith("generate node 'generate': AttributeError: 'NoneType' object has no attribute 'kv' (")
    assert message.endswith("in submit): a programming error, not a failed sample: the run stops")
    assert gen.counts["generation_errors"] == 0  # not counted as a failed sample


def test_a_refused_request_still_fails_only_its_sample(monkeypatch):
    gen = _generate(monkeypatch, _BrokenEngine(RequestRefused("request '0:0': empty prompt_ids")))
    gen.submit(0, 1, {"prompt": "1+1=", "answer": "2", "id": "a"})  # both samples refused: counted, no raise
    assert gen.counts["generation_errors"] == 2
    assert gen.monitor.kinds == {"generation error (RequestRefused)": 2}


class _Env(BaseEnv):
    """One turn; ``row["mode"]``: "bug" raises TypeError in step, "fail" raises KeyError."""

    def reset(self):
        return "go"

    def step(self, action):
        if self.config.get("mode") == "bug":
            return len(5)  # TypeError: a bug in the env
        if self.config.get("mode") == "fail":
            raise KeyError("row has no field 'x'")  # the env's data: this episode only
        return "", 1.0, True, {}


def _runner(engine=None) -> EpisodeRunner:
    attrs = {**ATTRS, "env": "one", "env_class": _Env, "max_turns": 1, "n_samples": 1}
    return EpisodeRunner(engine or FakeEngine(), TOK, attrs, SamplingParams(max_new_tokens=4), max_context=256)


def test_an_env_failure_ends_its_episode_a_bug_in_the_env_stops_the_run():
    runner = _runner()
    runner.submit(0, 1, {"id": 0, "answer": "7", "mode": "fail"})
    runner.submit(1, 1, {"id": 1, "answer": "7"})
    done = _drain(runner)
    assert len(done[0]) == 0 and len(done[1]) == 1 and runner.counts["episodes_failed"] == 1

    runner = _runner()
    runner.submit(0, 1, {"id": 0, "answer": "7", "mode": "bug"})
    with pytest.raises(ProgrammingError) as info:
        _drain(runner)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("env 'one': TypeError: object of type 'int' has no len() (")
    assert "test_bugs_stop_the_run.py:" in message and "in step): a programming error" in message


def test_a_refused_policy_turn_fails_its_episode_a_bug_in_the_engine_stops_the_run():
    runner = _runner(_BrokenEngine(RequestRefused("request '0:0/1#1': empty prompt_ids")))
    runner.submit(0, 1, {"id": 0, "answer": "7"})
    done = _drain(runner)
    assert len(done[0]) == 0 and runner.counts["episodes_failed"] == 1

    runner = _runner(_BrokenEngine(NameError("name 'slots' is not defined")))
    runner.submit(0, 1, {"id": 0, "answer": "7"})
    with pytest.raises(ProgrammingError, match=r"^env 'one': NameError: name 'slots' is not defined \(.*in submit\)"):
        _drain(runner)
