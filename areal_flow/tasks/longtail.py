"""Counting with long-tailed answer lengths: the task of the long-tail async benchmark.

Owns the problems, their length distribution and the rule reward of the ``longtail`` task.
A problem asks to count on from ``a`` to ``b``: ``{"prompt": "17:21=", "answer":
"18 19 20 21", "id": int}``. Every number is two digits (``10 <= a < b <= 99``), so an
answer of ``n = b - a`` numbers is ``3n - 1`` characters, ``3n`` tokens of the character
tokenizer with its EOS: from 3 tokens (``n = 1``) to ``3 * max_count`` (192 by default).

The count ``n`` follows a truncated Zipf law, the long right tail of response lengths in
reasoning RL (most answers short, a few very long):

    P(n = k) = k^(-s) / H,   H = sum_{j=1}^{max_count} j^(-s),   k = 1 .. max_count

(Zipf 1949; the truncated form, e.g. Newman 2005, "Power laws, Pareto distributions and
Zipf's law", eq. 2 with a finite support). With ``s = 1.1`` and ``max_count = 64`` the
median answer is 5 numbers (15 tokens), the mean 11.7 numbers (35 tokens), and a batch
of 16 prompts waits on average for one of ~48 numbers (143 tokens): a synchronous batch
spends most of its decode steps on a handful of long sequences.

Each next number is the previous one plus one (a local rule) and the answer stops at the
prompt's ``b``, so a tiny character model learns the task from a short supervised warm
start; the reward checks the whole sequence exactly.
"""

from __future__ import annotations

import bisect
import random

from areal_flow.tasks.held_out import TEST_ID_OFFSET

LOW, HIGH = 10, 99  # every number of a problem has two digits


def count_weights(max_count: int, exponent: float) -> list[float]:
    """``P(n = k)`` for ``k = 1 .. max_count`` (module doc, truncated Zipf); sums to 1.

    Raises:
        ValueError: ``max_count`` outside ``1 .. HIGH - LOW`` (89) or ``exponent < 0``.
    """
    if not 1 <= max_count <= HIGH - LOW:
        raise ValueError(f"LongTailTask: max_count must be in 1..{HIGH - LOW}, got {max_count}")
    if exponent < 0:
        raise ValueError(f"LongTailTask: exponent must be >= 0, got {exponent}")
    raw = [k ** -exponent for k in range(1, max_count + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def answer_tokens(n: int) -> int:
    """Tokens of the answer to a count of ``n`` numbers with its EOS: ``3n`` (``n`` two-digit
    numbers, ``n - 1`` spaces, EOS)."""
    return 3 * n


class LongTailTask:
    """Counting problems ``"a:b="`` -> ``"a+1 a+2 ... b"`` with a Zipf-distributed count.

    Args:
        seed: fixes the held-out test set (its own stream, independent of every
            ``train_problems`` seed).
        max_count: largest count ``n = b - a``, numbers (1..89); the longest answer is
            ``3 * max_count`` tokens.
        exponent: ``s`` of the Zipf law (module doc); 0 = uniform counts, larger = shorter.

    Raises:
        ValueError: ``max_count`` or ``exponent`` out of range (:func:`count_weights`).
    """

    name = "longtail"

    def __init__(self, seed: int = 0, max_count: int = 64, exponent: float = 1.1) -> None:
        self.weights = count_weights(max_count, exponent)
        self._cdf = [sum(self.weights[: k + 1]) for k in range(max_count)]
        self.seed, self.max_count, self.exponent = seed, max_count, exponent

    def spec(self) -> dict:
        """The parameters that define the task's data (cache keys of the warm start)."""
        return {"name": self.name, "seed": self.seed, "max_count": self.max_count, "exponent": self.exponent}

    @property
    def max_answer_tokens(self) -> int:
        """Longest answer with its EOS, tokens: ``3 * max_count``."""
        return answer_tokens(self.max_count)

    def draw_count(self, rng: random.Random) -> int:
        """One count ``n`` from the truncated Zipf law (inverse-CDF sampling)."""
        return min(bisect.bisect_left(self._cdf, rng.random()) + 1, self.max_count)

    def _draw(self, rng: random.Random, problem_id: int) -> dict:
        n = self.draw_count(rng)
        a = rng.randint(LOW, HIGH - n)
        return {"prompt": f"{a}:{a + n}=", "answer": " ".join(str(x) for x in range(a + 1, a + n + 1)),
                "id": problem_id}

    def test_set(self, n: int = 500) -> list[dict]:
        """``n`` fixed held-out problems (ids ``TEST_ID_OFFSET + i``); ``test_set(m)`` for
        ``m < n`` is a prefix of ``test_set(n)``. Prompts may repeat (the space of short
        counts is small)."""
        rng = random.Random(f"longtail-test:{self.seed}")
        return [self._draw(rng, TEST_ID_OFFSET + i) for i in range(n)]

    def train_problems(self, n: int, seed: int) -> list[dict]:
        """``n`` training problems drawn from ``seed``; ids are ``0 .. n-1``."""
        rng = random.Random(f"longtail-train:{self.seed}:{seed}")
        return [self._draw(rng, i) for i in range(n)]

    @staticmethod
    def correct(output_text: str, answer: str) -> bool:
        """Whether the response is the counted sequence (:meth:`reward` 1.0): the run's accuracy."""
        return LongTailTask.reward(output_text, answer) == 1.0

    @staticmethod
    def reward(output_text: str, answer: str, eos_token: str = "<eos>") -> float:
        """1.0 if the generated text is exactly the counted sequence, else 0.0; never raises.

        The text is cut at the first ``eos_token`` (if present) and stripped of surrounding
        whitespace; it must then equal ``answer`` character for character: for answer
        ``"18 19 20"``, ``" 18 19 20<eos>9"`` scores 1.0, ``"18 19"``, ``"18 19 20 21"`` and
        ``"18  19 20"`` score 0.0.
        """
        try:
            return 1.0 if str(output_text).split(eos_token, 1)[0].strip() == str(answer).strip() else 0.0
        except (TypeError, ValueError):
            return 0.0
