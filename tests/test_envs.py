"""Tool-call parsing, the shipped envs (support_desk, guess_number), their tasks' scripted
teachers, and the dialogue token layout of the supervised warm start. Expected values by hand."""

import random

import pytest

from areal_flow.envs import EnvError, env_class, make_env
from areal_flow.envs.episode import encode_dialogue
from areal_flow.envs.guess_number import GuessNumberEnv
from areal_flow.envs.support_desk import (CLARIFY, EXPLICIT, NOT_UNDERSTOOD, TOOLS, VAGUE, SupportDeskEnv,
                                          alphabet_safe)
from areal_flow.envs.tools import NOT_A_CALL, ToolCall, ToolCallError, parse_tool_call, tool_names
from areal_flow.models.presets import ALPHABET
from areal_flow.tasks.catalog import build_task
from areal_flow.tasks.guess_number import GuessNumberTask
from areal_flow.tasks.support_desk import SupportDeskTask, play, slip

# -- parse_tool_call ------------------------------------------------------------------

SCHEMA = [
    {"type": "function", "function": {"name": "refund", "parameters": {
        "type": "object", "properties": {"order": {"type": "integer"}, "note": {"type": "string"}},
        "required": ["order"]}}},
    {"type": "function", "function": {"name": "scale", "parameters": {
        "type": "object", "properties": {"factor": {"type": "number"}}, "required": ["factor"]}}},
    {"type": "function", "function": {"name": "end", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.mark.parametrize("text, expected", [
    ("refund(4821)", ToolCall("refund", {"order": 4821})),
    ("  refund(4821)  ", ToolCall("refund", {"order": 4821})),
    ("refund(order=4821)", ToolCall("refund", {"order": 4821})),
    ('refund("4821", note=late)', ToolCall("refund", {"order": 4821, "note": "late"})),  # bare word -> string
    ("refund(7, 12)", ToolCall("refund", {"order": 7, "note": "12"})),  # positional in properties order; int -> str
    ("scale(2)", ToolCall("scale", {"factor": 2.0})),
    ("refund(7, print(6*7))", ToolCall("refund", {"order": 7, "note": "print(6*7)"})),  # code -> its source text
    ("refund(7, note=a.b(1) + 2)", ToolCall("refund", {"order": 7, "note": "a.b(1) + 2"})),
    ("end()", ToolCall("end", {})),
    ('<tool_call>{"name": "refund", "arguments": {"order": "4821"}}</tool_call>', ToolCall("refund", {"order": 4821})),
    ('sure. <tool_call>\n{"name": "end", "arguments": {}}\n</tool_call>', ToolCall("end", {})),
    ('<tool_call>{"name": "refund", "arguments": "{\\"order\\": 5}"}</tool_call>', ToolCall("refund", {"order": 5})),
])
def test_parse_tool_call_accepts_both_formats(text, expected):
    assert parse_tool_call(text, SCHEMA) == expected


@pytest.mark.parametrize("text, reason", [
    ("how can i help", NOT_A_CALL),
    ("cancel(4821)", "unknown tool cancel, known tools refund, scale, end"),
    ("refund()", "refund needs argument order"),
    ("refund(1, 2, 3)", "refund takes 2 arguments, got 3"),
    ("refund(order=1, x=2)", "refund has no argument x"),
    ("refund(1, order=2)", "refund got argument order twice"),
    ("refund(abc)", "refund bad argument, 'abc' is not of type integer"),
    ("refund(1.5)", "refund bad argument, 1.5 is not of type integer"),
    ("refund(48+21)", "refund bad argument, '48+21' is not of type integer"),  # not evaluated
    ("refund(*orders)", "malformed call, expected name(arguments)"),
    ("scale(fast)", "scale bad argument, 'fast' is not of type number"),
    ("refund(4821", "malformed call, expected name(arguments)"),
    ("please refund(4821)", "malformed call, expected name(arguments)"),
    ("refund(order=1, order=2)", "malformed call, expected name(arguments)"),
    ("refund(1+)", "malformed call, expected name(arguments)"),
    ("<tool_call>{name: refund}</tool_call>", "tool call is not valid json"),
    ('<tool_call>{"arguments": {}}</tool_call>', "tool call json needs a name"),
    ('<tool_call>{"name": "refund", "arguments": [1]}</tool_call>', "tool call arguments must be an object"),
])
def test_parse_tool_call_errors_are_values_not_exceptions(text, reason):
    result = parse_tool_call(text, SCHEMA)
    assert result == ToolCallError(text, reason)
    assert result.is_call_attempt == (reason != NOT_A_CALL)


def test_tool_names_and_no_tools():
    assert tool_names(SCHEMA) == ["refund", "scale", "end"] and tool_names(None) == []
    assert parse_tool_call("end()", None).reason == "unknown tool end, known tools none"


# -- support_desk ---------------------------------------------------------------------

def _row(intent="refund", order=4821, explicit=True, template=1):
    from areal_flow.envs.support_desk import first_message

    return {"id": 0, "intent": intent, "order": order, "explicit": explicit, "template": template,
            "prompt": first_message(intent, order, explicit, template)}


def _run(env, turns, gamma=0.9):
    """Step ``env`` with the turn texts; returns (observations, rewards, infos, done, discounted return)."""
    obs, rewards, infos, done = [env.reset()], [], [], False
    for text in turns:
        assert not done
        o, r, done, info = env.step(parse_tool_call(text, env.tools))
        obs.append(o), rewards.append(r), infos.append(info)
    return obs, rewards, infos, done, sum(r * gamma**k for k, r in enumerate(rewards))


def test_support_desk_explicit_message_resolves_in_one_turn():
    env = make_env("support_desk", _row())
    assert env.action_space == "tool_call" and tool_names(env.tools) == ["lookup", "refund", "escalate", "end"]
    obs, rewards, infos, done, ret = _run(env, ["refund(4821)"])
    assert obs[0] == "my order 4821 is broken, refund it"
    assert rewards == [1.0] and done and infos == [{"resolved": 1, "tool_error": 0}] and ret == 1.0


def test_support_desk_vague_message_lookup_then_resolve():
    # refund behind a vague message: lookup (-0.1, reveals the complaint), refund (+1): G = -0.1 + 0.9 * 1 = 0.8
    env = SupportDeskEnv(_row(explicit=False, template=1))
    obs, rewards, infos, done, ret = _run(env, ["lookup(4821)", "refund(4821)"])
    assert obs[:2] == ["help with order 4821", "delivered. it is broken, refund it"]
    assert rewards == [-0.1, 1.0] and done and [i["resolved"] for i in infos] == [0, 1]
    assert ret == pytest.approx(0.8)
    # a track case is resolved by the lookup itself
    _, rewards, infos, done, _ = _run(SupportDeskEnv(_row("track", explicit=False)), ["lookup(4821)"])
    assert rewards == [1.0] and done and infos[0]["resolved"] == 1


def test_support_desk_question_gets_the_intent_other_text_does_not():
    # ask (-0.1), unclear text (-0.1), escalate (+1): G = -0.1 - 0.09 + 0.81 = 0.62
    env = SupportDeskEnv(_row("escalate", explicit=False, template=0))
    obs, rewards, infos, done, ret = _run(env, ["how can i help", "ok", "escalate(4821)"])
    assert obs[1:3] == [CLARIFY["escalate"], NOT_UNDERSTOOD] == ["i want a manager", "sorry, what do you mean"]
    assert [i["tool_error"] for i in infos] == [0, 0, 0] and done
    assert ret == pytest.approx(0.62)


def test_support_desk_wrong_terminal_tool_and_end_score_zero():
    for turn in ("escalate(4821)", "end()"):
        _, rewards, infos, done, ret = _run(SupportDeskEnv(_row("refund")), [turn])
        assert rewards == [0.0] and done and infos == [{"resolved": 0, "tool_error": 0}] and ret == 0.0
    _, rewards, infos, done, _ = _run(SupportDeskEnv(_row("track")), ["refund(4821)"])
    assert rewards == [0.0] and done and infos[0]["resolved"] == 0


def test_support_desk_bad_calls_get_an_error_observation_and_continue():
    env = SupportDeskEnv(_row("refund"))
    obs, rewards, infos, done, ret = _run(env, ["refund(4821", "cancel(4821)", "refund(1234)", "refund(4821)"])
    assert obs[1] == "error malformed call, expected name(arguments)"
    assert obs[2].startswith("error unknown tool cancel, known tools lookup")
    assert obs[3] == "no order 1234"
    assert all(set(o) <= set(ALPHABET) for o in obs)
    assert [i["tool_error"] for i in infos] == [1, 1, 1, 0] and [i["resolved"] for i in infos] == [0, 0, 0, 1]
    assert rewards == [-0.1, -0.1, -0.1, 1.0] and done
    assert ret == pytest.approx(-0.1 - 0.09 - 0.081 + 0.729)  # 0.458
    # a raw string is parsed by the env itself; the Hermes format works as well
    assert SupportDeskEnv(_row()).step("refund(4821)")[1] == 1.0
    hermes = '<tool_call>{"name": "refund", "arguments": {"order": 4821}}</tool_call>'
    assert SupportDeskEnv(_row()).step(parse_tool_call(hermes, TOOLS))[1:3] == (1.0, True)


def test_support_desk_instances_share_no_state():
    a, b = SupportDeskEnv(_row("refund", 1111)), SupportDeskEnv(_row("track", 2222))
    a.reset(), b.reset()
    assert a.step(parse_tool_call("lookup(1111)", TOOLS))[2] is False  # a: not a track case, goes on
    assert b.step(parse_tool_call("lookup(1111)", TOOLS))[0] == "no order 1111"  # b knows only its own order
    assert b.step(parse_tool_call("lookup(2222)", TOOLS))[1:3] == (1.0, True)
    assert a.step(parse_tool_call("refund(1111)", TOOLS))[1:3] == (1.0, True)
    assert SupportDeskEnv.tools is TOOLS and tool_names(TOOLS) == ["lookup", "refund", "escalate", "end"]


def test_support_desk_config_errors_and_registry():
    with pytest.raises(EnvError, match="intent"):
        SupportDeskEnv({"order": 1})
    with pytest.raises(EnvError, match="order"):
        SupportDeskEnv({"intent": "refund", "order": "x"})
    assert env_class("support_desk") is SupportDeskEnv and env_class("guess_number") is GuessNumberEnv
    with pytest.raises(EnvError, match="did you mean support_desk"):
        env_class("support_dsk")


def test_every_env_text_is_in_the_alphabet():
    texts = [t for ts in EXPLICIT.values() for t in ts] + list(VAGUE) + list(CLARIFY.values()) + [NOT_UNDERSTOOD]
    assert all(set(t.format(o=4821)) <= set(ALPHABET) for t in texts)
    assert alphabet_safe("Unknown tool 'X_y'; known: a") == "unknown tool x y known a"


# -- SupportDeskTask ------------------------------------------------------------------

def test_support_task_rows_are_deterministic_and_held_out():
    task = SupportDeskTask(seed=0)
    test = task.test_set(50)
    assert test == SupportDeskTask(seed=0).test_set(50) and test[:20] == task.test_set(20)
    assert test[0]["id"] == 1_000_000_000 and test != SupportDeskTask(seed=1).test_set(50)
    train = task.train_problems(300, seed=0)
    assert [r["id"] for r in train] == list(range(300)) and train == task.train_problems(300, seed=0)
    held = {(r["prompt"], r["intent"]) for r in task.test_set(500)}
    assert not held & {(r["prompt"], r["intent"]) for r in train}
    for r in train[:50]:  # the answer names the hidden case; the stored dialogue is the optimal teacher's
        assert r["answer"] == f"{r['intent']} {r['order']}" and str(r["order"]) in r["prompt"]
        assert r["segments"] == play(r, "optimal", None)[0] and r["segments"][0] == (r["prompt"], False)
    assert task.reward("refund(1)", "refund 1") == 0.0 and task.max_answer_tokens >= len("escalate(9999)") + 1


def test_support_teacher_resolution_follows_bug_rate():
    task = SupportDeskTask(seed=0)
    rows = task.test_set(200)
    perfect = task.teach(rows, 0.0)
    assert all(r["teacher"]["resolved"] for r in perfect)
    # optimal turns: explicit (p = 1/2) 1 turn; vague: lookup resolves track (1/3) in 1 turn, else 2:
    # E = 1/2 * 1 + 1/2 * (1/3 + 2/3 * 2) = 4/3 turns, plus one slip turn with probability 1/4.
    assert sum(r["teacher"]["turns"] for r in perfect) / 200 == pytest.approx(4 / 3 + 1 / 4, abs=0.15)
    # sloppy with probability b, then "wrong" with probability 1/2, unresolved on a vague message (p = 1/2):
    # E[resolved] = 1 - b/4 = 0.875 at b = 0.5; binomial sd on 200 = sqrt(0.875 * 0.125 / 200) = 0.023
    # -> +-4 sd = [0.78, 0.97].
    sloppy = task.teach(rows, 0.5)
    assert 0.78 <= sum(r["teacher"]["resolved"] for r in sloppy) / 200 <= 0.97
    assert all(r["teacher"]["resolved"] for r in sloppy if r["explicit"])  # explicit messages are never misread
    # the verbose "ask" agent: ask, look up, act -- 3 turns, 2 when the lookup resolves (track)
    asks = [r for r in sloppy if r["teacher"]["kind"] == "ask" and not r["teacher"]["slipped"]]
    assert asks and all(r["teacher"]["turns"] == (2 if r["intent"] == "track" else 3) for r in asks)
    assert all([s[0] for s in r["segments"][1::2]][:2] == ["how can i help", f"lookup({r['order']})"] for r in asks)
    assert {r["teacher"]["kind"] for r in sloppy} == {"optimal", "wrong", "ask", "lookup"}
    assert task.teach(rows, 0.5) == sloppy and sloppy[0]["segments"][0] == (rows[0]["prompt"], False)
    with pytest.raises(ValueError, match="bug_rate"):
        task.demonstrations(4, 0, 1.5)


def test_support_teacher_slips_are_context_and_recovered_from():
    task = SupportDeskTask(seed=0)
    rows = task.teach(task.test_set(200), 0.0)
    slipped = [r for r in rows if r["teacher"]["slipped"]]
    assert 30 <= len(slipped) <= 70  # binomial(200, 1/4): mean 50, sd 6.1
    for r in slipped:
        seg = r["segments"]
        assert seg[1][1:] == (True, False)  # a policy turn kept out of the loss
        assert seg[2][0].startswith(("error", "no order")) and not seg[2][1]  # the env says what went wrong
        assert seg[3:] == play(r, "optimal", None)[0][1:]  # then the optimal dialogue, as if fresh
    rng = random.Random(0)
    for _ in range(200):  # one edit of "lookup(4821)": a digit, the ")" or a letter of the name
        out = slip("lookup(4821)", rng)
        name, _, rest = out.partition("(")
        digit_changed = name == "lookup" and len(rest) == 5 and sum(a != b for a, b in zip(rest, "4821)")) == 1
        letter_dropped = rest == "4821)" and name in {"lookup"[:i] + "lookup"[i + 1:] for i in range(6)}
        assert digit_changed or out == "lookup(4821" or letter_dropped, out
    with pytest.raises(ValueError, match="not a call"):
        slip("end()", rng)


def test_turn_cost_comes_from_the_env_config():
    desk = SupportDeskEnv({"intent": "refund", "order": 4821, "turn_cost": 0.3})
    desk.reset()
    assert desk.step("lookup(4821)")[1] == -0.3 and desk.step("refund(4821)")[1] == 1.0
    game = GuessNumberEnv({"target": 7, "turn_cost": 0})
    assert game.step("3")[1] == 0.0
    for bad in (-0.1, "0.2", True):
        with pytest.raises(EnvError, match=r"support_desk: config turn_cost=.*env\.config\.turn_cost"):
            SupportDeskEnv({"intent": "refund", "order": 1, "turn_cost": bad})
    with pytest.raises(EnvError, match="guess_number: config turn_cost=-1"):
        GuessNumberEnv({"target": 7, "turn_cost": -1})


# -- guess_number ---------------------------------------------------------------------

def test_guess_number_by_hand():
    env = make_env("guess_number", {"target": 7})
    assert env.action_space == "text" and env.reset() == "guess a number from 1 to 20."
    steps = [env.step(t) for t in ("10", "5", "abc", "7")]
    assert [s[0] for s in steps] == ["lower.", "higher.", "say a number from 1 to 20.", "correct."]
    assert [s[1] for s in steps] == [-0.1, -0.1, -0.1, 1.0] and [s[2] for s in steps] == [False] * 3 + [True]
    assert [s[3]["invalid"] for s in steps] == [0, 0, 1, 0] and steps[-1][3]["resolved"] == 1
    with pytest.raises(EnvError, match="outside"):
        GuessNumberEnv({"target": 21})


def test_guess_number_task_bisects():
    task = GuessNumberTask(seed=0)
    # target 7: 10 lower -> [1, 9], guess 5 higher -> [6, 9], guess 7 correct
    row = task.test_set(20)[6]
    assert row["target"] == 7 and row["segments"] == [
        ("guess a number from 1 to 20.", False), ("10", True), ("lower.", False), ("5", True),
        ("higher.", False), ("7", True)]
    perfect = task.demonstrations(100, seed=0)
    assert all(r["teacher"]["resolved"] and r["teacher"]["turns"] <= 5 for r in perfect)  # ceil(log2(21)) = 5
    assert task.max_answer_tokens == 3 and task.spec() == {"name": "guess_number", "seed": 0, "high": 20}


def test_build_task_knows_the_env_tasks():
    assert isinstance(build_task({"name": "support_desk"}, 3), SupportDeskTask)
    assert build_task({"name": "guess_number"}, 3).seed == 3


# -- the warm start's token layout ---------------------------------------------------

def test_encode_dialogue_by_hand():
    from areal_flow.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    # ids: <bos>=1 <eos>=2, "0".."9" = 4..13, "." = 21, "a".."z" = 24..49 (h=31 i=32 l=35 o=38 w=46 e=28 r=41)
    ids, mask = encode_dialogue(tok, [("hi", False), ("5", True), ("lower.", False), ("2", True)])
    assert ids == [1, 31, 32, 9, 2, 35, 38, 46, 28, 41, 21, 2, 6, 2]  # "lower." ends with EOS, the prompt does not
    assert mask == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    # a non-target policy turn (a slip the dialogue recovers from) is context, not loss
    ids, mask = encode_dialogue(tok, [("hi", False), ("5", True, False), ("lower.", False), ("2", True, True)])
    assert ids == [1, 31, 32, 9, 2, 35, 38, 46, 28, 41, 21, 2, 6, 2]
    assert mask == [0] * 12 + [1, 1]


def test_sft_encodes_dialogue_rows_beside_prompt_rows():
    from areal_flow.models.tokenizer import build_char_tokenizer
    from runtime.engines.sft import encode_examples

    tok = build_char_tokenizer()
    ids, attn, loss_mask = encode_examples(tok, [{"prompt": "1+2=", "answer": "3"},
                                                 {"segments": [("hi", False), ("5", True)], "prompt": "hi"}])
    assert ids[0].tolist() == [1, 5, 14, 6, 18, 7, 2] and loss_mask[0].tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert ids[1].tolist() == [1, 31, 32, 9, 2, 0, 0] and attn[1].tolist() == [1] * 5 + [0, 0]
    assert loss_mask[1].tolist() == [0, 0, 0, 1, 1, 0, 0]
