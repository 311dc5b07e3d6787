"""OpenAI Agents SDK programs as rollout agents (``areal_flow.envs.agents_sdk``).

The SDK agent of ``graphs/arith_agents_sdk.py`` (an Agent with the ``add`` function tool,
run by the SDK's Runner, its model an ``AsyncOpenAI(base_url=...)`` client) plays against a
scripted engine: its tool call, the tool's result as a masked observation, the exact ids,
log-probs and versions of every token, by hand. An episode cut by ``max_turns`` earns the
truncated reward without failing; the SDK's absence is one error naming the extra; and
the graph trains end to end through the CLI.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from runs import REPO, cli_run, records
from test_agent_endpoint import EOS, FakeEngine, cid, ids, play

pytest.importorskip("agents", reason="the OpenAI Agents SDK: pip install 'areal-flow[envs]'")


def graph_module():
    """``graphs/arith_agents_sdk.py`` as a module (its ``agent`` is the program under test)."""
    spec = importlib.util.spec_from_file_location("arith_agents_sdk", REPO / "graphs" / "arith_agents_sdk.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class VersionedEngine(FakeEngine):
    """A scripted engine whose weights move on after every engine step (version 0, then 1, ...)."""

    def step(self):
        out = super().step()
        self.version += 1
        return out


def test_the_sdk_agent_calls_its_tool_and_the_episode_is_recorded_exactly():
    engine = VersionedEngine(replies=["add(3,4)", "7"])
    runner, done = play(graph_module().agent, [{"id": 0, "prompt": "3+4", "answer": "7"}], engine=engine, gamma=0.9)
    (t,) = done[0]
    # the prompt: the first call's one user message in the test template ("u <content>=a ")
    assert t.prompt_ids == ids("u 3+4=a ")
    # turn 0: the sampled call, exactly; the SDK ran add(3, 4) and sent its result as a tool
    # message ("t 7=", then the generation prompt "a "): 7 can only come from the tool
    call, obs, answer = ids("add(3,4)") + [EOS], ids("t 7=a "), [cid("7"), EOS]
    assert t.output_ids == call + obs + answer
    assert t.loss_mask == [1] * 9 + [0] * 6 + [1] * 2
    assert t.versions == [0] * 9 + [-1] * 6 + [1] * 2  # turn 1 sampled after the weights moved on
    assert t.behavior_logprobs == [-0.5] * 9 + [0.0] * 6 + [-0.5] * 2
    assert t.turn_ids == [0] * 15 + [1] * 2
    # the final output "7" is the answer: reward 1 on the last turn, G_0 = 0 + 0.9 * 1
    assert t.turn_rewards == [0.0, 1.0] and t.reward == pytest.approx(0.9)
    assert t.meta["turns"] == 2 and t.meta["tool_errors"] == 0
    # the engine saw the whole context for turn 1: the sampled ids were never re-tokenised
    assert engine.requests[1].prompt_ids == t.prompt_ids + call + obs
    assert runner.counts["episodes"] == 1 and runner.counts["episodes_failed"] == 0


def test_an_episode_cut_at_max_turns_earns_the_truncated_reward_and_does_not_fail():
    # the policy calls the tool on every turn: the SDK's max_turns=2 (the rollout's too) ends it
    runner, done = play(graph_module().agent, [{"id": 0, "prompt": "3+4", "answer": "7"}],
                        engine=FakeEngine(replies=["add(3,4)"]))
    (t,) = done[0]
    assert t.turn_rewards == [0.0, 0.0] and t.loss_mask.count(0) == len(ids("t 7=a "))
    assert runner.counts["episodes_failed"] == 0


def test_without_the_sdk_the_error_names_the_extra(monkeypatch):
    from areal_flow.envs.agents_sdk import require_agents, sdk_program

    monkeypatch.setitem(sys.modules, "agents", None)  # import agents -> ImportError
    with pytest.raises(ImportError, match=r"areal-flow\[envs\]"):
        require_agents()

    @sdk_program
    async def program(base_url: str, row: dict) -> float:
        return 1.0

    with pytest.raises(ImportError, match="openai-agents"):
        program("http://127.0.0.1:1/v1", {})


@pytest.mark.slow
def test_the_sdk_agent_trains_from_its_graph_file(tmp_path, warm_cache):
    """``areal-flow run graphs/arith_agents_sdk.py``, two steps: every episode played and trained."""
    cli_run(REPO / "graphs/arith_agents_sdk.py", "train.steps=2", "train.batch_size=2", "gen.n_samples=4",
            "warm_start.steps=10", "eval.n_test=8", f"out_dir={tmp_path}", "name=sdk")
    out = tmp_path / "sdk"
    trained = records(out)
    assert len(trained) == 2 * 2 * 4 == len({r["sample_id"] for r in trained})
    for r in trained:
        n = len(r["output_ids"])
        assert len(r["loss_mask"]) == len(r["versions"]) == len(r["behavior_logprobs"]) == n
        for mask, version, logprob in zip(r["loss_mask"], r["versions"], r["behavior_logprobs"]):
            # policy tokens: the engine's log-prob and the version that sampled them; observations: masked
            assert (version >= 0 and logprob < 0) if mask else (version == -1 and logprob == 0.0)
        assert 1 <= len(r["turn_rewards"]) <= 2 and r["turn_rewards"][:-1] == [0.0] * (len(r["turn_rewards"]) - 1)
        assert r["reward"] == pytest.approx(0.9 ** (len(r["turn_rewards"]) - 1) * r["turn_rewards"][-1])
        assert r["turn_rewards"][-1] in (0.0, 1.0)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == {"played": 2 * 2 * 4, "failed": 0, "errors": {}}
