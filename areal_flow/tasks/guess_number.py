"""Games of the ``guess_number`` env, and a binary-search teacher's dialogues.

A game row is ``{"id", "prompt", "answer", "target", "low", "high", "segments"}``:
``prompt`` = ``"guess a number from 1 to 20."`` (the same for every game), ``answer`` =
``str(target)`` for logs, and ``segments`` the optimal teacher's dialogue
(``[(text, is_policy), ...]``, played against the env). The teacher
(:meth:`GuessNumberTask.demonstrations`) bisects: it guesses ``(lo + hi) // 2`` of the
interval still consistent with the answers, except that with probability ``bug_rate``
per guess it guesses a uniform number of that interval (consistent, but slower).
"""

from __future__ import annotations

import random

from areal_flow.envs.guess_number import GuessNumberEnv, opening
from areal_flow.tasks.held_out import TEST_ID_OFFSET

MAX_TURNS = 8


def play(row: dict, bug_rate: float, rng: random.Random, max_turns: int = MAX_TURNS) -> tuple[list, dict]:
    """Play the (noisy) bisecting teacher against a fresh env, as the rollout loop does.
    Returns ``(segments, {"resolved", "turns", "return"})`` (undiscounted return)."""
    env = GuessNumberEnv(row)
    obs = env.reset()
    lo, hi = env.low, env.high
    segments, total, info = [(obs, False)], 0.0, {"resolved": 0}
    for turn in range(max_turns):
        guess = rng.randint(lo, hi) if bug_rate and rng.random() < bug_rate else (lo + hi) // 2
        segments.append((str(guess), True))
        obs, reward, done, info = env.step(str(guess))
        total += reward
        if done or turn + 1 == max_turns:
            break
        lo, hi = (guess + 1, hi) if obs == "higher." else (lo, guess - 1)
        segments.append((obs, False))
    env.close()
    return segments, {"resolved": info["resolved"], "turns": turn + 1, "return": total}


class GuessNumberTask:
    """Guess-the-number games over ``1..high``.

    Args:
        seed: seeds the training draws (the test set cycles through every number).
        high: largest hidden number, >= 1.

    Raises:
        ValueError: ``high < 1``.
    """

    name = "guess_number"
    env = "guess_number"
    max_turns = MAX_TURNS

    def __init__(self, seed: int = 0, high: int = 20) -> None:
        if high < 1:
            raise ValueError(f"GuessNumberTask: high must be >= 1, got {high}")
        self.seed = seed
        self.high = high

    @property
    def max_answer_tokens(self) -> int:
        """Per-turn token budget: the digits of ``high`` + EOS."""
        return len(str(self.high)) + 1

    def spec(self) -> dict:
        """The parameters that define the data (cache keys)."""
        return {"name": self.name, "seed": self.seed, "high": self.high}

    def _row(self, target: int, game_id: int) -> dict:
        row = {"id": game_id, "prompt": opening(1, self.high), "answer": str(target), "target": target,
               "low": 1, "high": self.high}
        row["segments"] = play(row, 0.0, random.Random(0))[0]
        return row

    def test_set(self, n: int = 500) -> list[dict]:
        """Held-out games ``target = 1 + i % high`` (every number equally often), ids
        ``TEST_ID_OFFSET + i``. (The prompt is the same for all games, so train and test
        differ only in their draws.)"""
        return [self._row(1 + i % self.high, TEST_ID_OFFSET + i) for i in range(n)]

    def train_problems(self, n: int, seed: int) -> list[dict]:
        """``n`` games with uniform targets drawn from ``seed``; ids ``0 .. n-1``."""
        rng = random.Random(f"guess-number-train:{self.seed}:{seed}")
        return [self._row(rng.randint(1, self.high), i) for i in range(n)]

    def demonstrations(self, n: int, seed: int, bug_rate: float = 0.0) -> list[dict]:
        """``train_problems(n, seed)`` with ``segments`` played by the noisy bisecting
        teacher (module doc) and ``teacher`` = ``{"resolved", "turns", "return"}``.

        Raises:
            ValueError: ``bug_rate`` outside [0, 1].
        """
        if not 0.0 <= bug_rate <= 1.0:
            raise ValueError(f"bug_rate must be in [0, 1], got {bug_rate}")
        rng = random.Random(f"guess-number-teacher:{self.seed}:{seed}")
        out = []
        for row in self.train_problems(n, seed):
            segments, stats = play(row, bug_rate, rng)
            out.append({**row, "segments": segments, "teacher": stats})
        return out

    @staticmethod
    def reward(output_text: str, answer: str) -> float:
        """Always 0.0: the rewards of this task come from the env (the interface requires it)."""
        return 0.0
