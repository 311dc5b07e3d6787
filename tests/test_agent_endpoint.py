"""Agent programs on the OpenAI-compatible endpoint: two chat calls with the official client
become one multi-turn trajectory (tokens, masks, rewards and usage by hand), a history that
does not extend the recording is refused naming the index, a raising or hanging agent ends
only its episode, unknown sessions 404, tool calls and streaming; and a graph file whose
rollout node runs an agent, end to end through the CLI."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from areal_flow.envs.agent import set_reward
from areal_flow.models.tokenizer import build_char_tokenizer
from runtime.engines.generation import GenerationResult, SamplingParams
from runtime.executors.episode_runner import EpisodeRunner
from runs import REPO, cli_run, records

ALPHABET = "0123456789+-*/=()., abcdefghijklmnopqrstuvwxyz"
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }} {{ m['content'] }}={% endfor %}"
            "{% if add_generation_prompt %}a {% endif %}")
EOS = 2
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


def cid(ch: str) -> int:
    """Character id by hand: 4 special tokens (<pad> <bos> <eos> <unk>), then the alphabet; others <unk> = 3."""
    return 4 + ALPHABET.index(ch) if ch in ALPHABET else 3


def ids(text: str) -> list[int]:
    return [cid(c) for c in text]


def chat_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


class FakeEngine:
    """Answers every request at once with the next of ``replies`` (cycling) + EOS, log-prob
    -0.5 per token, at ``version``; keeps the requests it got."""

    def __init__(self, replies=("7",)) -> None:
        self.version, self.pending, self.replies, self.requests = 0, [], list(replies), []

    def submit(self, request) -> None:
        self.pending.append(request)
        self.requests.append(request)

    def has_work(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[GenerationResult]:
        out = []
        for r in self.pending:
            reply = self.replies[(len(self.requests) - len(self.pending) + len(out)) % len(self.replies)]
            ids_ = ids(reply) + [EOS]
            out.append(GenerationResult(r.request_id, r.prompt_ids, ids_, [-0.5] * len(ids_),
                                        [self.version] * len(ids_), "stop", reply, r.meta))
        self.pending = []
        return out

    def update_weights(self, state_dict, version: int) -> None:
        self.version = version


ATTRS = dict(max_turns=2, gamma=1.0, n_samples=1, step_timeout_s=2.0, temperature=1.0, top_p=1.0, max_new_tokens=4,
             chat_template=None, env_config={})


def play(agent, rows, engine=None, tokenizer=None, max_context=256, **attrs):
    """Run ``agent`` on ``rows`` (one group each) to the end: ``(runner, {index: trajectories})``."""
    runner = EpisodeRunner(engine or FakeEngine(), tokenizer or chat_tokenizer(), {**ATTRS, "agent": agent, **attrs},
                           SamplingParams(temperature=1.0, max_new_tokens=4), max_context=max_context)
    done, started = {}, time.monotonic()
    try:
        for i, row in enumerate(rows):
            runner.submit(i, 1, row)
        while runner.has_work():
            assert time.monotonic() - started < 20, "episodes did not finish"
            done.update((index, trajs) for index, _, trajs in runner.step())
    finally:
        runner.close()
    return runner, done


def client(base_url: str):
    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)


def test_two_chat_calls_become_one_multi_turn_trajectory():
    seen = {}

    def agent(base_url: str, row: dict) -> float:
        c = client(base_url)
        user = {"role": "user", "content": row["prompt"]}
        first = c.chat.completions.create(model="anything", messages=[user], max_tokens=1, temperature=0.0)
        second = c.chat.completions.create(model="anything", messages=[
            user, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "ok"}], max_tokens=100)
        seen.update(first=first, second=second, turn_reward=set_reward(base_url, 0.5))
        return 1.0

    engine = FakeEngine(replies=["7", "8"])
    runner, done = play(agent, [{"id": 0, "prompt": "3+4"}], engine=engine)
    (t,) = done[0]
    # the prompt: the template's rendering of the first call's messages, no <bos>
    assert t.prompt_ids == ids("u 3+4=a ")
    # turn 0: the engine's ids; the new user message as the template adds it after the sampled
    # EOS (the assistant turn's closing "=" is the EOS's); turn 1: the engine's ids
    obs = ids("u ok=a ")
    assert t.output_ids == [cid("7"), EOS] + obs + [cid("8"), EOS]
    assert t.loss_mask == [1, 1] + [0] * 7 + [1, 1]
    assert t.turn_ids == [0, 0] + [0] * 7 + [1, 1]
    assert t.versions == [0, 0] + [-1] * 7 + [0, 0]
    assert t.behavior_logprobs == [-0.5, -0.5] + [0.0] * 7 + [-0.5, -0.5]
    assert t.turn_rewards == [0.0, 1.5] and t.reward == 1.5 and seen["turn_reward"] == 0.5
    assert t.meta["turns"] == 2 and t.meta["tool_errors"] == 0
    # the engine saw the whole context, with the node's sampling; max_tokens only lowers the budget
    assert engine.requests[1].prompt_ids == t.prompt_ids + [cid("7"), EOS] + obs
    assert [r.params.max_new_tokens for r in engine.requests] == [1, 4]
    assert {r.params.temperature for r in engine.requests} == {1.0}  # the request's 0.0 is ignored
    first, second = seen["first"], seen["second"]
    assert first.object == "chat.completion" and first.model == "policy"
    assert first.choices[0].message.role == "assistant" and first.choices[0].message.content == "7"
    assert first.choices[0].finish_reason == "stop" and first.choices[0].message.tool_calls is None
    assert second.choices[0].message.content == "8"
    # usage by hand: prompt = the whole context the policy saw, completion = its ids (EOS included)
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (8, 2, 10)
    assert (second.usage.prompt_tokens, second.usage.completion_tokens, second.usage.total_tokens) == (17, 2, 19)
    assert runner.counts == {"episodes": 1, "episodes_failed": 0, "env_timeouts": 0, "tool_call_errors": 0,
                             "empty_episodes": 0}


def test_a_history_that_does_not_extend_the_recording_is_refused_naming_the_index():
    errors = []

    def agent(base_url: str, row: dict) -> None:
        c = client(base_url)
        user = {"role": "user", "content": "3+4"}
        c.chat.completions.create(model="m", messages=[user])
        for messages in ([user, {"role": "assistant", "content": "9"}, {"role": "user", "content": "ok"}],  # edited
                         [user, {"role": "user", "content": "ok"}],  # the reply left out
                         [user]):  # a retry of the first call
            with pytest.raises(openai.BadRequestError) as info:
                c.chat.completions.create(model="m", messages=messages)
            errors.append(info.value)

    _, done = play(agent, [{"id": 0}])
    assert [e.status_code for e in errors] == [400, 400, 400]
    assert all(e.body["code"] == "history_mismatch" for e in errors)
    assert "messages[1]" in errors[0].body["message"] and "'9'" in errors[0].body["message"]
    assert "messages[1]" in errors[1].body["message"]
    assert "message 1 (assistant) is missing" in errors[2].body["message"]
    (t,) = done[0]  # the refused calls left no trace in the episode
    assert t.output_ids == [cid("7"), EOS] and t.turn_rewards == [0.0]


def test_a_raising_hanging_or_silent_agent_fails_only_its_episode():
    def agent(base_url: str, row: dict) -> float:
        if row["mode"] == "silent":  # no chat call at all
            return 1.0
        client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}])
        if row["mode"] == "raise":
            raise RuntimeError("agent broke")
        if row["mode"] == "hang":
            time.sleep(4)
        return 1.0

    started = time.monotonic()
    runner, done = play(agent, [{"mode": m} for m in ("ok", "raise", "hang", "silent")], step_timeout_s=1.0)
    assert time.monotonic() - started < 3.5  # the hanging agent did not hold its group
    assert [len(done[i]) for i in range(4)] == [1, 0, 0, 0]
    assert done[0][0].turn_rewards == [1.0]
    assert runner.counts == {"episodes": 4, "episodes_failed": 3, "env_timeouts": 1, "tool_call_errors": 0,
                             "empty_episodes": 0}


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_unknown_sessions_models_rewards_and_max_turns():
    out = {}

    def agent(base_url: str, row: dict) -> None:
        c = client(base_url)
        out["models"] = [m.id for m in c.models.list()]
        with pytest.raises(RuntimeError, match="before the policy's first turn"):
            set_reward(base_url, 1.0)
        unknown = base_url.rsplit("/episodes/", 1)[0] + "/episodes/nope/v1"
        out["404"] = _post(unknown + "/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        out["404 reward"] = _post(unknown[: -len("/v1")] + "/reward", {"reward": 1})
        with pytest.raises(openai.NotFoundError):
            client(unknown).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        messages = [{"role": "user", "content": "go"}]
        for _ in range(2):  # max_turns=2
            reply = c.chat.completions.create(model="m", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        out["bad reward"] = _post(base_url[: -len("/v1")] + "/reward", {"reward": "high"})
        with pytest.raises(openai.BadRequestError, match="max_turns reached") as info:
            c.chat.completions.create(model="m", messages=messages)
        out["max_turns"] = info.value.body["code"]

    _, done = play(agent, [{"id": 0}])
    assert out["models"] == ["policy"]
    assert out["404"][0] == 404 and "no episode session 'nope'" in out["404"][1]["error"]["message"]
    assert out["404 reward"][0] == 404
    assert out["bad reward"][0] == 400 and "reward='high'" in out["bad reward"][1]["error"]["message"]
    assert out["max_turns"] == "max_turns_reached"
    (t,) = done[0]  # the refused third call's messages were not appended
    assert t.turn_rewards == [0.0, 0.0] and t.output_ids[-2:] == [cid("7"), EOS]


def test_a_context_past_max_context_is_refused_and_ends_the_episode():
    codes = []

    def agent(base_url: str, row: dict) -> float:
        c = client(base_url)
        messages = [{"role": "user", "content": "3+4"}]  # prompt "u 3+4=a ": 8 tokens
        reply = c.chat.completions.create(model="m", messages=messages)  # + 2 sampled
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "ok"}]
        for _ in range(2):  # + 7 observation tokens = 17 >= max_context - 1; then the episode has ended
            with pytest.raises(openai.BadRequestError) as info:
                c.chat.completions.create(model="m", messages=messages)
            codes.append(info.value.body["code"])
        return 1.0

    _, done = play(agent, [{"id": 0}], max_context=18)
    assert codes == ["context_length_exceeded", "episode_ended"]
    (t,) = done[0]  # ends with the (masked) observation, as an env episode cut by max_context
    assert t.finish_reason == "length" and t.output_ids == [cid("7"), EOS] + ids("u ok=a ")
    assert t.loss_mask == [1, 1] + [0] * 7 and t.turn_rewards == [1.0]


def test_tool_calls_in_the_reply_and_tool_call_errors():
    hermes = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": "4"}}</tool_call>'
    replies = {}

    def agent(base_url: str, row: dict) -> None:
        c = client(base_url)
        messages = [{"role": "user", "content": "3+4"}]
        first = c.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "7"}]
        replies.update(first=first, second=c.chat.completions.create(model="m", messages=messages, tools=TOOLS))

    _, done = play(agent, [{"id": 0}], engine=FakeEngine([hermes, "add(3"]))
    first, second = replies["first"], replies["second"]
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    (call,) = first.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 3, "b": 4}  # coerced by the schema
    # a malformed call attempt stays text and counts as a tool-call error
    assert second.choices[0].message.content == "add(3" and second.choices[0].message.tool_calls is None
    assert second.choices[0].finish_reason == "stop"
    (t,) = done[0]
    assert t.meta["tool_errors"] == 1
    # the tool result is the observation between the turns: "t 7=" then the generation prompt
    n_first = len(hermes) + 1
    assert t.output_ids[n_first:n_first + len("t 7=a ")] == ids("t 7=a ")


def test_streaming_answers_one_content_chunk_and_the_finish():
    chunks = []

    def agent(base_url: str, row: dict) -> None:
        stream = client(base_url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "3+4"}], stream=True,
            stream_options={"include_usage": True})
        chunks.extend(stream)

    _, done = play(agent, [{"id": 0}])
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == "7" and finish == ["stop"]
    assert chunks[-1].usage.prompt_tokens == 8 and chunks[-1].usage.completion_tokens == 2
    assert done[0][0].output_ids == [cid("7"), EOS]


@pytest.mark.slow
def test_the_shipped_agent_program_trains_from_its_graph_file(tmp_path, warm_cache):
    """``graphs/arith_openai_agent.py``: an ``openai``-client agent with two tries per problem."""
    cli_run(REPO / "graphs/arith_openai_agent.py", "train.steps=2", "train.batch_size=2", "gen.n_samples=4",
            "warm_start.steps=10", "eval.n_test=8", f"out_dir={tmp_path}", "name=agent")
    out = tmp_path / "agent"
    trained = records(out)
    assert len(trained) == 2 * 2 * 4 == len({r["sample_id"] for r in trained})  # every sample trained once
    assert any(len(r["turn_rewards"]) == 2 for r in trained)
    for r in trained:
        assert 1 <= len(r["turn_rewards"]) <= 2
        assert r["reward"] == pytest.approx(sum(x * 0.9**k for k, x in enumerate(r["turn_rewards"])))
        if len(r["turn_rewards"]) == 2:  # set_reward credited the missed first turn; "again=" is masked
            assert r["turn_rewards"][0] == pytest.approx(-0.1) and 0 in r["loss_mask"]
        else:
            assert r["turn_rewards"] == [1.0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes_before"]["failed"] == summary["episodes_after"]["failed"] == 0
    assert summary["workers"]["rollout/0"]["episodes"] == 2 * 2 * 4
    assert summary["workers"]["rollout/0"]["episodes_failed"] == 0
    assert summary["episodes"] == {"played": 2 * 2 * 4, "failed": 0, "errors": {}}
