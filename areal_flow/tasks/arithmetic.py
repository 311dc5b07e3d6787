"""Integer addition/subtraction problems with an exact-answer rule reward.

A problem is ``{"prompt": "37+58=", "answer": "95", "id": int}``. Operands have 1 to
``max_digits`` digits (the digit count is drawn uniformly first, then the value
uniformly among numbers with that many digits, so short operands are not swamped);
subtraction results may be negative (``"12-40="`` -> ``"-28"``).

With ``prompt_style="chat"`` the same problems are phrased as a question for an
instruction-tuned model, ``"What is 37 + 58? Answer with just the number."``, and scored
with the math reward (the final number of the reply, ``"37 + 58 = 95"`` scores 1), so a
chat model that talks around its answer is not scored 0 for the talking.
"""

from __future__ import annotations

import random
import re

from areal_flow.tasks.held_out import HELD_OUT, TEST_ID_OFFSET, check_held_out

_INTEGER = re.compile(r"[+-]?[0-9]{1,40}")
_OPERATION = re.compile(r"(\d+)([+-])(\d+)=")


def sum_without_carry(a: int, b: int) -> int:
    """``a + b`` digit by digit with every carry dropped: ``58 + 67`` -> ``15`` (8+7=15 -> 5, 5+6=11 -> 1)."""
    result, place = 0, 1
    while a or b:
        result += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return result


def smaller_from_larger(a: int, b: int) -> int:
    """``a - b`` (``a >= b >= 0``) with no borrow: each column takes the smaller digit
    from the larger, ``52 - 17`` -> ``45`` (|2-7| = 5, 5-1 = 4; true difference 35)."""
    result, place = 0, 1
    while a or b:
        result += abs(a % 10 - b % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return result


def buggy_answer(a: int, op: str, b: int) -> int:
    """The answer of a pupil with the two classic column-arithmetic bugs of Brown & Burton
    (1978), "Diagnostic models for procedural bugs in basic mathematical skills",
    Cognitive Science 2(2): additions drop every carry (:func:`sum_without_carry`),
    subtractions take the smaller digit from the larger (:func:`smaller_from_larger`;
    for ``a < b`` the sign is kept: ``-(smaller_from_larger(b, a))``). Equal to the true
    answer whenever no carry or borrow is needed."""
    if op == "+":
        return sum_without_carry(a, b)
    return smaller_from_larger(a, b) if a >= b else -smaller_from_larger(b, a)


def _chat_reward(output_text: str, answer: str) -> float:
    """The chat style's reward: ``areal_flow.rewards.math.math_reward`` (imported on first use)."""
    from areal_flow.rewards.math import math_reward

    return math_reward(output_text, answer)


class ArithmeticTask:
    """Arithmetic problems over ``ops`` with operands of up to ``max_digits`` digits.

    Args:
        seed: fixes the held-out test set (drawn from its own stream, independent of
            every ``train_problems`` seed).
        max_digits: largest operand length, digits, >= 1.
        ops: operators to draw from, a non-empty subset of ``"+-"``.
        prompt_style: ``"plain"`` (``"37+58="``, exact-integer reward) or ``"chat"``
            (a question, math reward; see the module docstring).

    Raises:
        ValueError: ``max_digits < 1``, ``ops`` empty / containing other characters, or
            an unknown ``prompt_style``.
    """

    name = "arithmetic"
    PROMPT_STYLES = ("plain", "chat")
    CHAT_ANSWER_TOKENS = 24
    """Chat style greedy-evaluation budget, tokens: room for "37 + 58 = 95" and some talk."""

    def __init__(self, seed: int = 0, max_digits: int = 3, ops: str = "+-", prompt_style: str = "plain") -> None:
        if max_digits < 1:
            raise ValueError(f"ArithmeticTask: max_digits must be >= 1, got {max_digits}")
        if not ops or set(ops) - set("+-"):
            raise ValueError(f"ArithmeticTask: ops must be a non-empty subset of '+-', got {ops!r}")
        if prompt_style not in self.PROMPT_STYLES:
            raise ValueError(f"ArithmeticTask: prompt_style must be one of {self.PROMPT_STYLES}, got {prompt_style!r}")
        self.seed = seed
        self.prompt_style = prompt_style
        if prompt_style == "chat":
            self.reward = _chat_reward  # shadows the exact-integer rule for this instance
        self.max_digits = max_digits
        self.ops = "".join(sorted(set(ops), key=ops.index))
        self._test_cache: dict[int, list[dict]] = {}

    def spec(self) -> dict:
        """The parameters that define the task's data, e.g. for cache keys (``prompt_style``
        only when not ``"plain"``, so plain-style keys stay what they were)."""
        spec = {"name": self.name, "seed": self.seed, "max_digits": self.max_digits, "ops": self.ops}
        return spec if self.prompt_style == "plain" else {**spec, "prompt_style": self.prompt_style}

    @property
    def max_answer_tokens(self) -> int:
        """Plain: longest answer in characters plus one for EOS: sign + (max_digits + 1)
        digits + EOS. Chat: ``CHAT_ANSWER_TOKENS``."""
        return self.CHAT_ANSWER_TOKENS if self.prompt_style == "chat" else self.max_digits + 3

    def _draw(self, rng: random.Random, problem_id: int) -> dict:
        a, b = self._operand(rng), self._operand(rng)
        op = rng.choice(self.ops)
        value = a + b if op == "+" else a - b
        prompt = f"What is {a} {op} {b}? Answer with just the number." if self.prompt_style == "chat" else f"{a}{op}{b}="
        return {"prompt": prompt, "answer": str(value), "id": problem_id}

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)

    def test_set(self, n: int = HELD_OUT) -> list[dict]:
        """The fixed held-out problems: the same list for the same ``(seed, max_digits, ops, n)``.

        Prompts are unique within the set; ids are ``TEST_ID_OFFSET + i``. ``test_set(m)``
        for ``m < n`` is a prefix of ``test_set(n)``.

        Raises:
            ValueError: ``n`` > ``held_out.HELD_OUT``, the problems training keeps out.
        """
        check_held_out(self.name, n, "test_set n")
        return self._held_out_rows(n)

    def _held_out_rows(self, n: int) -> list[dict]:
        """``test_set(n)`` without the cap: what ``train_problems`` excludes may be more."""
        if n not in self._test_cache:
            rng = random.Random(f"arithmetic-test:{self.seed}")
            seen: set[str] = set()
            out: list[dict] = []
            # Bounded so a tiny problem space (max_digits=1) cannot loop forever.
            for _ in range(100 * n + 1000):
                if len(out) == n:
                    break
                p = self._draw(rng, TEST_ID_OFFSET + len(out))
                if p["prompt"] not in seen:
                    seen.add(p["prompt"])
                    out.append(p)
            self._test_cache[n] = out
        return [dict(p) for p in self._test_cache[n]]

    def train_problems(self, n: int, seed: int, exclude_test: int = HELD_OUT) -> list[dict]:
        """``n`` training problems drawn from ``seed``; ids are ``0 .. n-1``.

        Prompts of ``test_set(exclude_test)`` are rejected and redrawn, so training never
        sees a held-out problem (when the problem space is too small to avoid them,
        e.g. ``max_digits=1``, the rejection gives up after 20 redraws and keeps the draw).
        """
        rng = random.Random(f"arithmetic-train:{self.seed}:{seed}")
        held_out = {p["prompt"] for p in self._held_out_rows(exclude_test)} if exclude_test else set()
        out = []
        for i in range(n):
            p = self._draw(rng, i)
            for _ in range(20):
                if p["prompt"] not in held_out:
                    break
                p = self._draw(rng, i)
            out.append(p)
        return out

    def demonstrations(self, n: int, seed: int, bug_rate: float = 0.0) -> list[dict]:
        """``train_problems(n, seed)`` with answers as an imperfect teacher writes them.

        A problem that needs a carry or a borrow gets, with probability ``bug_rate``, the
        :func:`buggy_answer` (``58+67=`` -> ``15``, ``52-17=`` -> ``45``) instead of the
        right one: a systematic misconception the supervised warm start imitates and RL
        with the exact reward must unlearn. Other problems keep their right answer.

        Raises:
            ValueError: ``bug_rate`` outside ``[0, 1]``.
        """
        if not 0.0 <= bug_rate <= 1.0:
            raise ValueError(f"bug_rate must be in [0, 1], got {bug_rate}")
        rng = random.Random(f"arithmetic-teacher:{self.seed}:{seed}")
        out = []
        for p in self.train_problems(n, seed):
            match = _OPERATION.fullmatch(p["prompt"])  # plain prompts only
            if match and rng.random() < bug_rate:
                p = {**p, "answer": str(buggy_answer(int(match.group(1)), match.group(2), int(match.group(3))))}
            out.append(p)
        return out

    ANSWER_KINDS = ("right", "buggy procedure", "other")

    def answer_kind(self, problem: dict, output_text: str) -> str:
        """Classify one answer: ``"right"`` (reward 1), ``"buggy procedure"`` (the
        :func:`buggy_answer` of a problem that needs a carry or borrow, i.e. the warm-start
        teacher's misconception) or ``"other"`` (any other wrong answer; also every wrong
        answer to a chat-style prompt)."""
        if self.reward(output_text, problem["answer"]) == 1.0:
            return "right"
        match = _OPERATION.fullmatch(problem["prompt"])
        if match:
            bug = buggy_answer(int(match.group(1)), match.group(2), int(match.group(3)))
            if bug != int(problem["answer"]) and ArithmeticTask.reward(output_text, str(bug)) == 1.0:
                return "buggy procedure"
        return "other"

    def correct(self, output_text: str, answer: str) -> bool:
        """Whether the response states the right answer (this task's reward 1.0, the chat style's
        math reward included): the run's accuracy."""
        return self.reward(output_text, answer) == 1.0

    @staticmethod
    def reward(output_text: str, answer: str, eos_token: str = "<eos>") -> float:
        """1.0 if the generated text states the right integer, else 0.0; never raises.

        The text is cut at the first ``eos_token`` (if present) and stripped of
        surrounding whitespace; what remains must be a whole integer (optional sign,
        1-40 digits, nothing else) whose value equals ``int(answer)``. So ``" 95<eos>7"``
        scores 1.0 for answer ``"95"`` and ``"95 apples"``, ``"9 5"`` or ``""`` score 0.0.
        """
        try:
            text = str(output_text).split(eos_token, 1)[0].strip()
            if not _INTEGER.fullmatch(text):
                return 0.0
            return 1.0 if int(text) == int(str(answer).strip()) else 0.0
        except (ValueError, TypeError):
            return 0.0
