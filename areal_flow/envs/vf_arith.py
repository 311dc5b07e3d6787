"""An arithmetic environment in the ``verifiers`` format (prime-rl's environments).

A verifiers environment module exposes ``load_environment(**env_args) -> vf.Environment``;
``ops.rollout(policy, prompts, env="verifiers:areal_flow.envs.vf_arith")`` loads this one
through ``verifiers.load_environment`` (``areal_flow.envs.verifiers_env``), exactly as
prime-rl loads an installed environment by its id. It imports ``verifiers`` at the top, as
any verifiers environment does: importing it needs the ``envs`` extra.

* ``turns=1``: a ``vf.SingleTurnEnv``: the policy answers ``"37+58="`` once.
* ``turns=2``: a ``vf.MultiTurnEnv`` with two tries: a wrong first answer gets the user
  message ``"again="``; a right answer ends the episode (a ``@vf.stop`` condition).
* ``tool=True``: a ``vf.ToolEnv`` with the tool ``add(a, b)``: the policy may call it
  (verifiers runs it and answers with a ``tool`` message) before it answers; a turn
  without a tool call ends the episode; at most ``turns + 1`` turns.

The rubric (``vf.Rubric``): ``correct_answer`` (weight 1): 1.0 when the last answer, the
parser's ``parse_answer`` of the completion stripped, equals ``answer``, else 0.0;
``extra_turns`` (weight ``-turn_cost``): the policy turns after the first. So a first-try
answer scores 1.0, a second-try one ``1 - turn_cost`` (0.9 by default), a wrong one 0 or
``-turn_cost``. The dataset: ``n`` problems ``a+b=`` / ``a-b=`` with operands of up to
``max_digits`` digits, in the prompt format of ``areal_flow.tasks.arithmetic`` (what the tiny
arithmetic model is warm-started on), columns ``question`` and ``answer``. Like any
verifiers environment it depends on verifiers and datasets alone, not on areal-flow.
"""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset

RETRY_MESSAGE = "again="
"""The user message after a wrong first answer (``turns=2``); the tiny model's prompts end in ``=``."""


def _last_answer(parser, completion) -> str:
    return (parser.parse_answer(completion) or "").strip()


def correct_answer(parser, completion, answer, **kwargs) -> float:
    """1.0 when the completion's last answer is ``answer``, else 0.0."""
    return 1.0 if _last_answer(parser, completion) == str(answer).strip() else 0.0


def extra_turns(state, **kwargs) -> float:
    """Policy turns after the first (``len(state["trajectory"]) - 1``)."""
    return float(max(len(state["trajectory"]) - 1, 0))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term.
        b: the second term.
    """
    return a + b


class TwoTries(vf.MultiTurnEnv):
    """Two tries at a problem: ``"again="`` after a wrong answer; done once it is right."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content=RETRY_MESSAGE)]

    @vf.stop
    async def solved(self, state) -> bool:
        trajectory = state["trajectory"]
        return bool(trajectory) and correct_answer(self.parser, trajectory[-1]["completion"], state["answer"]) > 0


def load_environment(turns: int = 1, n: int = 1000, seed: int = 0, max_digits: int = 2,
                     turn_cost: float = 0.1, tool: bool = False) -> vf.Environment:
    """The environment (module doc).

    Args:
        turns: 1 (single-turn) or 2 (two tries).
        tool: a ``vf.ToolEnv`` with ``add`` instead (``turns + 1`` turns at most).
        n: dataset rows; seed / max_digits: of the arithmetic problems.
        turn_cost: the weight of ``extra_turns`` is ``-turn_cost``.

    Raises:
        ValueError: ``turns`` not 1 or 2.
    """
    if turns not in (1, 2):
        raise ValueError(f"vf_arith: turns={turns!r}, expected 1 or 2")
    rng, high = random.Random(seed), 10 ** max_digits
    rows = []
    for _ in range(n):
        a, b, op = rng.randrange(high), rng.randrange(high), rng.choice("+-")
        rows.append({"question": f"{a}{op}{b}=", "answer": str(a + b if op == "+" else a - b)})
    dataset = Dataset.from_list(rows)
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[correct_answer, extra_turns], weights=[1.0, -turn_cost], parser=parser)
    if tool:
        return vf.ToolEnv(dataset=dataset, parser=parser, rubric=rubric, tools=[add], max_turns=turns + 1)
    if turns == 1:
        return vf.SingleTurnEnv(dataset=dataset, parser=parser, rubric=rubric)
    return TwoTries(dataset=dataset, parser=parser, rubric=rubric, max_turns=2)
