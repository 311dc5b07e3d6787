"""``tool_multiply``: multiplication problems for the ``python_math`` env, and a scripted
teacher's dialogues that compute them with the Python tool (or, sloppily, do not).

A problem is ``{"id", "prompt": "347*29=", "answer": "10063", "a", "b", "segments"}``:
operands of 2 to ``max_digits`` digits (the digit count drawn uniformly first, then the
value), a product the tiny character model cannot compute in its head but can copy.
``segments`` is the tool-using teacher's dialogue in the rollout's layout
(``[(text, is_policy), ...]``, ``areal_flow.envs.episode.encode_dialogue``)::

    347*29=                  (the prompt: the env's first observation)
    python(print(347*29))    (policy: the tool call, call syntax; quotes are not in the
                              character tokenizer's alphabet, so the code is the bare
                              argument, ``areal_flow.envs.tools``)
    10063                    (the tool's output, what ``run_python`` prints)
    10063                    (policy: a plain-text turn, the final answer)

With probability ``bug_rate`` per episode (:meth:`ToolMultiplyTask.demonstrations`) the
teacher answers at once without the tool (the right product, written from memory): the
warm-started policy then calls the tool on about ``1 - bug_rate`` of the problems and
guesses on the rest, which it gets mostly wrong; RL on the env's reward (1 for the right
final answer, ``areal_flow.rewards.math.math_reward``) is what makes it call the tool.
"""

from __future__ import annotations

import random

from areal_flow.tasks.held_out import HELD_OUT, TEST_ID_OFFSET, check_held_out


def tool_dialogue(a: int, b: int) -> list[tuple[str, bool]]:
    """The tool-using teacher's dialogue for ``a*b`` (module doc); the observation is the
    product as ``print`` writes it, what the ``python_math`` env shows after the call."""
    return [(f"{a}*{b}=", False), (f"python(print({a}*{b}))", True), (str(a * b), False), (str(a * b), True)]


def direct_dialogue(a: int, b: int) -> list[tuple[str, bool]]:
    """The sloppy teacher's dialogue: the product at once, no tool call."""
    return [(f"{a}*{b}=", False), (str(a * b), True)]


class ToolMultiplyTask:
    """``a*b=`` problems, operands of 2 to ``max_digits`` digits.

    Args:
        seed: fixes the held-out test set (its own random stream).
        max_digits: longest operand, digits, in 2..4 (the call ``python(print(9999*9999))``
            is 25 characters, within the per-turn budget :attr:`max_answer_tokens`).

    Raises:
        ValueError: ``max_digits`` outside 2..4.
    """

    name = "tool_multiply"
    max_answer_tokens = 26
    """Per-turn token budget: the longest call (25 characters) + EOS."""

    def __init__(self, seed: int = 0, max_digits: int = 3) -> None:
        if isinstance(max_digits, bool) or not isinstance(max_digits, int) or not 2 <= max_digits <= 4:
            raise ValueError(f"ToolMultiplyTask: max_digits must be an int in 2..4, got {max_digits!r}")
        self.seed = seed
        self.max_digits = max_digits
        self._test_cache: dict[int, list[dict]] = {}

    def spec(self) -> dict:
        """The parameters that define the data (cache keys)."""
        return {"name": self.name, "seed": self.seed, "max_digits": self.max_digits, "version": 1}

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(2, self.max_digits)
        return rng.randint(10 ** (digits - 1), 10**digits - 1)

    def _draw(self, rng: random.Random, problem_id: int) -> dict:
        a, b = self._operand(rng), self._operand(rng)
        return {"id": problem_id, "prompt": f"{a}*{b}=", "answer": str(a * b), "a": a, "b": b,
                "segments": tool_dialogue(a, b)}

    def test_set(self, n: int = HELD_OUT) -> list[dict]:
        """The fixed held-out problems (ids ``TEST_ID_OFFSET + i``, prompts unique);
        ``test_set(m)`` for ``m < n`` is a prefix of ``test_set(n)``.

        Raises:
            ValueError: ``n`` > ``held_out.HELD_OUT``, the problems training keeps out.
        """
        check_held_out(self.name, n, "test_set n")
        return self._held_out_rows(n)

    def _held_out_rows(self, n: int) -> list[dict]:
        """``test_set(n)`` without the cap: what ``train_problems`` excludes may be more."""
        if n not in self._test_cache:
            rng = random.Random(f"tool-multiply-test:{self.seed}:{self.max_digits}")
            out: list[dict] = []
            seen: set[str] = set()
            while len(out) < n:
                row = self._draw(rng, TEST_ID_OFFSET + len(out))
                if row["prompt"] not in seen:
                    seen.add(row["prompt"])
                    out.append(row)
            self._test_cache[n] = out
        return [dict(r) for r in self._test_cache[n]]

    def train_problems(self, n: int, seed: int, exclude_test: int = HELD_OUT) -> list[dict]:
        """``n`` training problems drawn from ``seed`` (ids ``0 .. n-1``); a prompt of
        ``test_set(exclude_test)`` is redrawn."""
        rng = random.Random(f"tool-multiply-train:{self.seed}:{self.max_digits}:{seed}")
        held_out = {r["prompt"] for r in self._held_out_rows(exclude_test)} if exclude_test else set()
        out = []
        for i in range(n):
            row = self._draw(rng, i)
            while row["prompt"] in held_out:
                row = self._draw(rng, i)
            out.append(row)
        return out

    def demonstrations(self, n: int, seed: int, bug_rate: float = 0.0) -> list[dict]:
        """``train_problems(n, seed)`` whose ``segments`` are, with probability ``bug_rate``
        per problem, :func:`direct_dialogue` (no tool) instead of :func:`tool_dialogue`;
        ``teacher`` (``"tool"`` or ``"direct"``) says which.

        Raises:
            ValueError: ``bug_rate`` outside [0, 1].
        """
        if not 0.0 <= bug_rate <= 1.0:
            raise ValueError(f"bug_rate must be in [0, 1], got {bug_rate}")
        rng = random.Random(f"tool-multiply-teacher:{self.seed}:{seed}")
        out = []
        for row in self.train_problems(n, seed):
            direct = rng.random() < bug_rate
            segments = direct_dialogue(row["a"], row["b"]) if direct else row["segments"]
            out.append({**row, "segments": segments, "teacher": "direct" if direct else "tool"})
        return out

    @staticmethod
    def reward(output_text: str, answer: str) -> float:
        """Always 0.0: the rewards of this task come from the ``python_math`` env (the task
        interface requires the method)."""
        return 0.0
