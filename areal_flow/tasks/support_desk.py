"""Scenarios of the ``support_desk`` env, and a scripted (optionally sloppy) agent's dialogues.

A scenario row is ``{"id", "prompt", "answer", "intent", "order", "explicit", "template",
"segments"}``: ``prompt`` is the customer's first message, ``answer`` (``"refund 4821"``)
names the hidden case for logs, ``intent`` / ``order`` / ``explicit`` / ``template`` are what
the env (:class:`~areal_flow.envs.support_desk.SupportDeskEnv`) and the teacher read, and
``segments`` is the optimal teacher's dialogue (``[(text, is_policy), ...]``, played
against the env) so a supervised warm start on ``train_problems`` imitates a good agent.
A rollout reads only ``prompt`` and the hidden fields.

The teacher (:meth:`SupportDeskTask.demonstrations`) acts optimally -- the resolving call
at once after an explicit message; ``lookup`` first after a vague one (it resolves a
``track`` case, else reveals the intent) -- or, with probability ``bug_rate`` per
episode, sloppily, in one of three ways (weights :data:`SLOPPY_KINDS`): ``wrong`` jumps to
a terminal call after a vague message without finding out what the customer wants (a
wrong tool: unresolved, 1 turn; after an explicit message it acts optimally, so the
dialogues never teach a wrong reading of an explicit message), ``ask`` is verbose: it asks
``"how can i help"`` first, then looks up the order, then acts (3 turns; 2 for a
``track`` case, which the lookup resolves), ``lookup`` looks up first even when the
message is explicit (an extra turn where it was not needed). So the teacher resolves
``1 - bug_rate / 4`` of the cases in expectation (half the messages are vague), and its
needless turns are what RL can remove: the optimal teacher takes 4/3 turns on average,
``ask`` 8/3, ``lookup`` 5/3.

Independently, with probability :data:`SLIP_RATE` a dialogue opens with a slip: the
first call the teacher was about to make, with one digit of the order changed, its
closing parenthesis lost or a letter of the tool name dropped (what a sampling policy
does); the env answers with its error observation and the teacher goes on as it would
have. The slip stays in the context but out of the loss (``is_target`` False in
``segments``), so the warm start learns to recover from an error observation, not to
make the slip.
"""

from __future__ import annotations

import random

from areal_flow.envs.support_desk import EXPLICIT, INTENTS, RESOLVING_TOOL, VAGUE, SupportDeskEnv, first_message
from areal_flow.envs.tools import parse_tool_call
from areal_flow.tasks.held_out import HELD_OUT, TEST_ID_OFFSET, check_held_out

SLOPPY_KINDS = (("wrong", 0.5), ("ask", 0.3), ("lookup", 0.2))
"""A sloppy episode's kind and its probability."""
QUESTION = "how can i help"
MAX_TURNS = 8
SLIP_RATE = 0.25
"""Probability that a teacher's dialogue opens with a slip it recovers from (module doc)."""


def teacher_turn(row: dict, kind: str, turn: int, rng: random.Random) -> str:
    """The scripted agent's ``turn``-th (0-based) turn text for ``row`` in mode ``kind``
    (``"optimal"`` or a :data:`SLOPPY_KINDS` name); ``rng`` picks the wrong tool."""
    order, intent = row["order"], row["intent"]
    right = f"{RESOLVING_TOOL[intent]}({order})"
    if kind == "ask":
        return (QUESTION, f"lookup({order})", right)[min(turn, 2)]
    if turn > 0:
        return right
    if kind == "wrong" and not row["explicit"]:
        return f"{rng.choice([t for t in ('refund', 'escalate') if t != RESOLVING_TOOL[intent]])}({order})"
    if kind == "lookup" or not row["explicit"]:
        return f"lookup({order})"
    return right


def slip(call: str, rng: random.Random) -> str:
    """``call`` (``"lookup(4821)"``) as a sampling policy might get it wrong: one digit of
    the order changed, the closing parenthesis lost, or one letter of the tool name dropped.

    Raises:
        ValueError: ``call`` is not ``name(digits)``.
    """
    name, _, order = call.removesuffix(")").partition("(")
    if not (name and order.isdigit() and call.endswith(")")):
        raise ValueError(f"slip: {call!r} is not a call name(digits)")
    how = rng.randrange(3)
    if how == 0:
        i = rng.randrange(len(order))
        digit = rng.choice([d for d in "0123456789" if d != order[i] and (i or d != "0")])
        return f"{name}({order[:i]}{digit}{order[i + 1:]})"
    if how == 1:
        return f"{name}({order}"
    i = rng.randrange(len(name))
    return f"{name[:i]}{name[i + 1:]}({order})"


def play(row: dict, kind: str, rng: random.Random, max_turns: int = MAX_TURNS,
         slipped: bool = False) -> tuple[list, dict]:
    """Play the teacher against a fresh env, as the rollout loop does (the observation after
    the last turn is not included); ``slipped``: open with a :func:`slip` of the first call
    (a non-target segment, module doc). Returns ``(segments, {"resolved", "turns",
    "return"})`` (``turns`` counts the slip; ``return``: undiscounted sum of the turn rewards)."""
    env = SupportDeskEnv(row)
    obs = env.reset()
    segments, total, info = [(obs, False)], 0.0, {"resolved": 0}
    turns = [(teacher_turn(row, kind, t, rng), True) for t in range(max_turns)]
    if slipped:
        first = turns[0][0] if turns[0][0].endswith(")") else f"lookup({row['order']})"
        turns = [(slip(first, rng), False)] + turns[:-1]
    for turn, (text, target) in enumerate(turns):
        segments.append((text, True) if target else (text, True, False))
        obs, reward, done, info = env.step(parse_tool_call(text, env.tools))
        total += reward
        if done or turn + 1 == max_turns:
            break
        segments.append((obs, False))
    env.close()
    return segments, {"resolved": info["resolved"], "turns": turn + 1, "return": total}


class SupportDeskTask:
    """Support-desk scenarios: intents uniform over :data:`INTENTS`, ``order_digits``-digit
    order numbers, an explicit first message with probability ``explicit_rate``.

    Args:
        seed: fixes the held-out test set (its own random stream).
        explicit_rate: probability that the first message reveals the intent, in [0, 1].
        order_digits: digits of an order number (``dataset.max_digits``).

    Raises:
        ValueError: ``explicit_rate`` outside [0, 1], or ``order_digits`` outside 1..6.
    """

    name = "support_desk"
    env = "support_desk"
    max_answer_tokens = 16
    """Per-turn token budget: ``escalate(4821)`` is 14 characters + EOS."""
    max_turns = MAX_TURNS

    def __init__(self, seed: int = 0, explicit_rate: float = 0.5, order_digits: int = 4) -> None:
        if not 0.0 <= explicit_rate <= 1.0:
            raise ValueError(f"SupportDeskTask: explicit_rate must be in [0, 1], got {explicit_rate}")
        if not 1 <= order_digits <= 6:
            raise ValueError(f"SupportDeskTask: order_digits must be in 1..6, got {order_digits}")
        self.seed = seed
        self.explicit_rate = explicit_rate
        self.order_digits = order_digits
        self._test_cache: dict[int, list[dict]] = {}

    def spec(self) -> dict:
        """The parameters that define the data (cache keys)."""
        spec = {"name": self.name, "seed": self.seed, "explicit_rate": self.explicit_rate, "version": 1}
        return spec if self.order_digits == 4 else {**spec, "order_digits": self.order_digits}

    def _draw(self, rng: random.Random, scenario_id: int) -> dict:
        intent = rng.choice(INTENTS)
        order = rng.randint(10 ** (self.order_digits - 1), 10**self.order_digits - 1)
        explicit = rng.random() < self.explicit_rate
        template = rng.randrange(len(EXPLICIT[intent]) if explicit else len(VAGUE))
        row = {"id": scenario_id, "prompt": first_message(intent, order, explicit, template),
               "answer": f"{intent} {order}", "intent": intent, "order": order, "explicit": explicit,
               "template": template}
        row["segments"] = play(row, "optimal", rng)[0]
        return row

    def test_set(self, n: int = HELD_OUT) -> list[dict]:
        """The fixed held-out scenarios (ids ``TEST_ID_OFFSET + i``); ``test_set(m)`` for
        ``m < n`` is a prefix of ``test_set(n)``.

        Raises:
            ValueError: ``n`` > ``held_out.HELD_OUT``, the scenarios training keeps out.
        """
        check_held_out(self.name, n, "test_set n")
        return self._held_out_rows(n)

    def _held_out_rows(self, n: int) -> list[dict]:
        """``test_set(n)`` without the cap: what ``train_problems`` excludes may be more."""
        if n not in self._test_cache:
            rng = random.Random(f"support-desk-test:{self.seed}")
            self._test_cache[n] = [self._draw(rng, TEST_ID_OFFSET + i) for i in range(n)]
        return [dict(r) for r in self._test_cache[n]]

    def train_problems(self, n: int, seed: int, exclude_test: int = HELD_OUT) -> list[dict]:
        """``n`` training scenarios drawn from ``seed`` (ids ``0 .. n-1``); a scenario of
        ``test_set(exclude_test)`` (same prompt and intent) is redrawn."""
        rng = random.Random(f"support-desk-train:{self.seed}:{seed}")
        held_out = {(r["prompt"], r["intent"]) for r in self._held_out_rows(exclude_test)} if exclude_test else set()
        out = []
        for i in range(n):
            row = self._draw(rng, i)
            while (row["prompt"], row["intent"]) in held_out:
                row = self._draw(rng, i)
            out.append(row)
        return out

    def demonstrations(self, n: int, seed: int, bug_rate: float = 0.0) -> list[dict]:
        """``train_problems(n, seed)`` played by the teacher, sloppy with probability
        ``bug_rate`` (:meth:`teach`).

        Raises:
            ValueError: ``bug_rate`` outside [0, 1].
        """
        return self.teach(self.train_problems(n, seed), bug_rate, seed)

    def teach(self, rows: list[dict], bug_rate: float, seed: int = 0) -> list[dict]:
        """``rows`` with ``segments`` replaced by the teacher's dialogue (sloppy with
        probability ``bug_rate`` per episode, opening with a slip with probability
        :data:`SLIP_RATE`, module doc; seeded by ``seed``) and ``teacher`` =
        ``{"kind", "slipped", "resolved", "turns", "return"}`` added.

        Raises:
            ValueError: ``bug_rate`` outside [0, 1].
        """
        if not 0.0 <= bug_rate <= 1.0:
            raise ValueError(f"bug_rate must be in [0, 1], got {bug_rate}")
        rng = random.Random(f"support-desk-teacher:{self.seed}:{seed}")
        kinds, weights = zip(*SLOPPY_KINDS)
        out = []
        for row in rows:
            kind = rng.choices(kinds, weights)[0] if rng.random() < bug_rate else "optimal"
            slipped = rng.random() < SLIP_RATE
            segments, stats = play(row, kind, rng, slipped=slipped)
            out.append({**row, "segments": segments, "teacher": {"kind": kind, "slipped": slipped, **stats}})
        return out

    @staticmethod
    def reward(output_text: str, answer: str) -> float:
        """Always 0.0: the rewards of this task come from the env, turn by turn (the task
        interface requires the method)."""
        return 0.0
