"""``verifiers`` environments as rollout envs (``env="verifiers:<id>"``,
``areal_flow.envs.verifiers_env``), with ``areal_flow/envs/vf_arith.py``, an arithmetic
environment written in the verifiers format (single-turn, and two tries with ``"again="``).

Against a scripted engine: the environment's own loop decides the turns, the sampled ids,
log-probs and versions are kept exactly, its message between turns is a masked observation,
and its rubric's score is the reward (1 for the right last answer, -0.1 per extra turn, by
hand). Trace-time errors name the node; verifiers' signal handlers never replace the
worker's; and the graph trains end to end through the CLI, every reward recomputed from the
rubric's definition.
"""

from __future__ import annotations

import json
import signal
import threading
from types import SimpleNamespace

import pytest

from areal_flow import Model, flow, ops
from areal_flow.graph import GraphError
from runs import REPO, cli_run, records
from test_agent_endpoint import EOS, FakeEngine, cid, ids, play

pytest.importorskip("verifiers", reason="verifiers environments: pip install 'areal-flow[envs]'")

from areal_flow.envs.verifiers_env import VerifiersProgram, load, rollout_input  # noqa: E402

ENV = "areal_flow.envs.vf_arith"
ROW = {"id": 0, "prompt": "3+4", "answer": "7"}


class VersionedEngine(FakeEngine):
    """A scripted engine whose weights move on after every engine step (version 0, then 1, ...)."""

    def step(self):
        out = super().step()
        self.version += 1
        return out


def episode(replies, turns: int, engine_cls=FakeEngine, **env_args):
    """One episode of ``vf_arith(turns=..., **env_args)`` on ``ROW`` with the engine's
    ``replies``: ``(runner, trajectory or None)``. The generous step timeout covers the first load."""
    runner, done = play(VerifiersProgram(ENV, {"turns": turns, "n": 4, **env_args}), [ROW],
                        engine=engine_cls(replies), max_turns=3, step_timeout_s=60)
    trajs = done.get(0, [])
    return runner, (trajs[0] if trajs else None)


def test_two_tries_the_retry_message_is_masked_and_the_rubric_scores_by_hand():
    runner, t = episode(["8", "7"], turns=2, engine_cls=VersionedEngine)
    assert t.prompt_ids == ids("u 3+4=a ")  # the row's text as one user message (the env has no system prompt)
    retry = ids("u again==a ")  # "u <content>=" for the env's "again=" after the wrong 8, then "a "
    assert t.output_ids == [cid("8"), EOS] + retry + [cid("7"), EOS]
    assert t.loss_mask == [1, 1] + [0] * len(retry) + [1, 1]
    assert t.versions == [0, 0] + [-1] * len(retry) + [1, 1]  # the weights moved between the turns
    assert t.behavior_logprobs == [-0.5, -0.5] + [0.0] * len(retry) + [-0.5, -0.5]
    # rubric: correct_answer 1 x 1.0 + extra_turns 1 x (-0.1) = 0.9, on the last turn
    assert t.turn_rewards == [0.0, pytest.approx(0.9)] and t.reward == pytest.approx(0.9)
    assert runner.counts["episodes_failed"] == 0


@pytest.mark.parametrize("replies, turns, rewards", [
    (["7"], 2, [1.0]),           # right at once: the env's stop condition ends it after one turn
    (["8", "9"], 2, [0.0, -0.1]),  # wrong twice: 0 - 0.1
    (["7"], 1, [1.0]),           # single-turn, right
    (["8"], 1, [0.0]),           # single-turn, wrong
    ([""], 1, [0.0]),            # an empty reply: verifiers aborts; the policy's turn is scored 0, not failed
])
def test_the_rubric_is_the_reward(replies, turns, rewards):
    runner, t = episode(replies, turns)
    assert t is not None and t.turn_rewards == pytest.approx(rewards)
    assert len([m for m in t.loss_mask if m]) == sum(len(r) + 1 for r in replies[:len(rewards)])  # each reply + EOS
    assert runner.counts["episodes_failed"] == 0


def test_a_tool_env_gets_the_policys_call_and_its_tool_result_is_an_observation():
    # vf.ToolEnv with add(a, b): the policy's call syntax comes back to verifiers as
    # tool_calls, verifiers runs add(3, 4), its "7" is the tool message; the plain "7" ends it
    runner, t = episode(["add(3,4)", "7"], turns=1, tool=True)
    result = ids("t 7=a ")  # "t <content>=" for the tool message, then the generation prompt
    assert t.output_ids == ids("add(3,4)") + [EOS] + result + [cid("7"), EOS]
    assert t.loss_mask == [1] * 9 + [0] * len(result) + [1, 1]
    assert t.turn_rewards == [0.0, pytest.approx(0.9)]  # right answer, one extra turn: 1 - 0.1
    assert t.meta["tool_errors"] == 0 and runner.counts["episodes_failed"] == 0


def test_rows_of_the_envs_own_dataset_and_text_rows_become_its_input():
    env = SimpleNamespace(system_prompt="be brief", few_shot=[{"role": "user", "content": "1+1"},
                                                             {"role": "assistant", "content": "2"}])
    text = rollout_input(env, {"id": 3, "prompt": "2+2", "answer": 4, "info": {"k": 1}})
    assert text == {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1"},
                               {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2"}],
                    "example_id": 3, "answer": "4", "info": {"k": 1}}
    own = load(ENV, {"turns": 1, "n": 4}).get_dataset()[0]  # a row as verifiers formats its dataset
    assert rollout_input(env, own)["prompt"] == own["prompt"] == [{"role": "user", "content": own["question"]}]


def test_loading_in_an_episode_thread_keeps_the_workers_signal_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    errors = []

    def build():
        try:
            load(ENV, {"turns": 2, "n": 3})  # verifiers' Environment.__init__ calls signal.signal
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    assert errors == [] and {s: signal.getsignal(s) for s in before} == before


def test_the_envs_own_dataset_as_a_task_with_a_held_out_tail():
    from areal_flow.config import ConfigError, DatasetConfig
    from areal_flow.tasks.catalog import build_task

    task = build_task({"name": f"verifiers:{ENV}", "options": {"n": 20}}, seed=3)
    data = load(ENV, {"n": 20}).get_dataset()  # no eval_dataset: the last 10 % (2 rows) are held out
    test = task.test_set(5)
    assert [r["prompt"] for r in test] == [data[18]["question"], data[19]["question"]]
    assert [r["id"] for r in test] == [1_000_000_000, 1_000_000_001]
    train = task.train_problems(40, seed=1)  # 18 training rows, shuffled, repeated to 40
    assert [r["id"] for r in train] == list(range(40))
    assert sorted(r["example_id"] for r in train[:18]) == list(range(18)) == sorted(r["example_id"] for r in train[18:36])
    row = train[0]  # the environment's own messages are the rollout's input
    assert row["messages"] == [{"role": "user", "content": row["prompt"]}] == rollout_input(None, row)["prompt"]
    assert row["answer"] == data[row["example_id"]]["answer"]
    with pytest.raises(ConfigError, match="no module 'nope_env'"):
        DatasetConfig(name="verifiers:nope-env")


def _trace(env, **kwargs):
    @flow
    def g(cfg):
        policy = Model("policy", "tiny-arith")
        episodes = ops.rollout(policy, ops.dataset({"name": "arithmetic"}), env=env, **kwargs)
        stats = ops.train_step(policy, ops.advantage(episodes), algorithm="grpo")
        ops.sync_weights(policy, to=episodes)
        return stats

    return g(None)


def test_trace_time_errors_name_the_node():
    with pytest.raises(GraphError, match=r"node 'rollout'.*no module 'no_such_vf_env'"):
        _trace("verifiers:no-such-vf-env")
    with pytest.raises(GraphError, match=r"name the environment"):
        _trace("verifiers:")
    with pytest.raises(GraphError, match="exactly one of env="):
        _trace(f"verifiers:{ENV}", agent=lambda base_url, row: 0.0)
    (node,) = _trace(f"verifiers:{ENV}", env_config={"turns": 2}).nodes_of("rollout")
    assert isinstance(node.attrs["agent"], VerifiersProgram) and node.attrs["agent"].env_args == {"turns": 2}


def rubric_reward(texts: list[str], answer: str, turn_cost: float = 0.1) -> float:
    """vf_arith's rubric by its definition, from the policy's turn texts: verifiers records
    the turns up to the first empty reply (where it aborts); 1 for a right last recorded
    answer, minus ``turn_cost`` per recorded turn after the first."""
    steps = next((i for i, text in enumerate(texts) if not text), len(texts))
    right = steps > 0 and texts[steps - 1] == answer
    return float(right) - turn_cost * max(steps - 1, 0)


@pytest.mark.slow
def test_the_verifiers_env_trains_from_its_graph_file(tmp_path, warm_cache):
    """``areal-flow run graphs/verifiers_agent.py``, two steps: every episode played and
    trained, each reward the rubric's (recomputed from the sampled text)."""
    cli_run(REPO / "graphs/verifiers_agent.py", "train.steps=2", "train.batch_size=2", "gen.n_samples=4",
            "warm_start.steps=10", "eval.n_test=4", f"out_dir={tmp_path}", "name=vf")
    out = tmp_path / "vf"
    trained = records(out)
    assert len(trained) == 2 * 2 * 4 == len({r["sample_id"] for r in trained})
    for r in trained:
        texts = [t.strip() for t in r["output_text"].split("\nagain=\n")]
        assert len(texts) == len(r["turn_rewards"]) <= 2
        assert r["turn_rewards"][-1] == pytest.approx(rubric_reward(texts, r["meta"]["answer"]))
        for mask, version in zip(r["loss_mask"], r["versions"]):
            assert (version >= 0) if mask else (version == -1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == {"played": 2 * 2 * 4, "failed": 0, "errors": {}}
