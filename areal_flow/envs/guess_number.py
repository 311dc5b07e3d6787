"""``guess_number``: guess a hidden integer, told "higher" or "lower" after each guess.

A plain-text env (no tools): the policy's turn is a number (``"10"``); the observation is
``"higher."`` (the hidden number is larger), ``"lower."`` or, on a turn that is not an
integer, ``"say a number from LOW to HIGH."``. The right guess ends the episode.

Rewards per turn: ``+1.0`` for the right guess, ``-turn_cost`` for every other turn
(config ``turn_cost``, default :data:`TURN_COST` = 0.1). A binary search finds any number of ``1..20`` within 5 guesses.
"""

from __future__ import annotations

import re

from areal_flow.envs.base import BaseEnv, EnvError, register_env, turn_cost

TURN_COST = 0.1
_INTEGER = re.compile(r"[+-]?\d{1,9}")


def opening(low: int, high: int) -> str:
    """The first observation: ``"guess a number from 1 to 20."``."""
    return f"guess a number from {low} to {high}."


@register_env("guess_number")
class GuessNumberEnv(BaseEnv):
    """One game; deterministic given ``config``.

    Config (the dataset row, see ``areal_flow.tasks.guess_number``): ``target`` (int),
    optional ``low`` / ``high`` (defaults 1 / 20, shown in the prompt), ``prompt`` and
    ``turn_cost`` (default :data:`TURN_COST`).
    ``step`` takes the turn's text and returns ``info = {"resolved": 0/1, "invalid": 0/1}``
    (``invalid``: the turn was not an integer).

    Raises:
        EnvError: ``target`` missing or not an integer, or outside ``low..high``;
            ``turn_cost`` not a number >= 0.
    """

    def __init__(self, config: dict | None = None) -> None:
        super().__init__(config)
        try:
            self.target = int(self.config["target"])
            self.low, self.high = int(self.config.get("low", 1)), int(self.config.get("high", 20))
        except (KeyError, TypeError, ValueError):
            raise EnvError(f"guess_number: config target={self.config.get('target')!r}, expected an integer") from None
        if not self.low <= self.target <= self.high:
            raise EnvError(f"guess_number: target {self.target} outside {self.low}..{self.high}")
        self.turn_cost = turn_cost("guess_number", self.config, TURN_COST)

    def reset(self) -> str:
        return self.config.get("prompt") or opening(self.low, self.high)

    def step(self, action) -> tuple[str, float, bool, dict]:
        text = str(getattr(action, "text", action)).strip()  # a ToolCallError carries the text too
        if not _INTEGER.fullmatch(text):
            return f"say a number from {self.low} to {self.high}.", -self.turn_cost, False, {"resolved": 0, "invalid": 1}
        guess = int(text)
        if guess == self.target:
            return "correct.", 1.0, True, {"resolved": 1, "invalid": 0}
        return ("higher." if self.target > guess else "lower."), -self.turn_cost, False, {"resolved": 0, "invalid": 0}
