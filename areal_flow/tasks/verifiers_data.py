"""A ``verifiers`` environment's own dataset as a task: ``dataset.name: verifiers:<env id>``.

prime-rl trains an environment on the rows it ships (its ``dataset``, formatted by
verifiers: ``prompt`` chat messages, ``answer``, ``info``, ``example_id``). This task serves
those rows to ``ops.rollout(..., env="verifiers:<env id>")``: the environment is loaded as
the rollout loads it (``areal_flow.envs.verifiers_env.load``, with ``dataset.options`` as
its ``load_environment`` arguments: give the rollout's ``env.config`` the same), and each
row keeps the environment's messages under ``messages`` (the rollout's input, used as
they are) with ``prompt`` the text of its last user message (the port type's text, what
logs and a supervised warm start read).

Held-out rows: the environment's ``eval_dataset`` when it has one; else the last
:data:`HELD_OUT_FRACTION` of its ``dataset`` (at least one row), which training then never
draws. Training rows: the rest, shuffled with the run's seed and repeated as often as the run needs (an
environment's dataset is finite). Rewards come from the environment's rubric, not from
this task (:meth:`VerifiersTask.reward` is 0).
"""

from __future__ import annotations

import random

from areal_flow.envs.verifiers_env import PREFIX, load
from areal_flow.tasks.held_out import TEST_ID_OFFSET

HELD_OUT_FRACTION = 0.1
"""Without an ``eval_dataset``: the share of the dataset's rows, at its end, kept for held-out evaluation."""


def _text(message) -> str:
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", "")
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(getattr(p, "text", "")) for p in content)
    return str(content or "")


def _as_dict(message) -> dict:
    return dict(message) if isinstance(message, dict) else message.model_dump(exclude_none=True)


class VerifiersTask:
    """The rows of a verifiers environment's dataset (module doc).

    Args:
        env_id: the environment's id or module (``dataset.name`` without ``verifiers:``).
        env_args: its ``load_environment`` arguments (``dataset.options``).
        seed: the run's seed (the order of the training rows).

    Raises:
        ValueError / ImportError: as ``verifiers_env.check_spec`` and ``load``.
    """

    def __init__(self, env_id: str, env_args: dict | None = None, seed: int = 0) -> None:
        self.env_id, self.env_args, self.seed = env_id, dict(env_args or {}), seed
        self.name = PREFIX + env_id

    def spec(self) -> dict:
        """The parameters that define the task's data (cache keys of the warm start)."""
        return {"name": self.name, "options": self.env_args, "seed": self.seed}

    def _environment(self):
        return load(self.env_id, self.env_args)

    def _split(self):
        """``(training data, its row count, held-out data, held-out row indices)``."""
        environment = self._environment()
        data = environment.get_dataset()
        environment.build_eval_dataset()
        if environment.eval_dataset is not None:
            return data, len(data), environment.eval_dataset, range(len(environment.eval_dataset))
        held = max(1, int(len(data) * HELD_OUT_FRACTION)) if len(data) > 1 else 0
        return data, len(data) - held, data, range(len(data) - held, len(data))

    @staticmethod
    def _row(entry: dict, row_id: int) -> dict:
        messages = [_as_dict(m) for m in entry["prompt"]]
        users = [m for m in messages if m.get("role") == "user"]
        row = {"id": row_id, "prompt": _text(users[-1]) if users else "", "messages": messages,
               "answer": str(entry.get("answer", "")), "example_id": entry.get("example_id", row_id)}
        if entry.get("info"):
            row["info"] = entry["info"]
        return row

    def test_set(self, n: int = 500) -> list[dict]:
        """The first ``n`` held-out rows (fewer when there are fewer), ids ``TEST_ID_OFFSET + i``."""
        _, _, held, indices = self._split()
        return [self._row(held[i], TEST_ID_OFFSET + k) for k, i in enumerate(indices[:n])]

    def train_problems(self, n: int, seed: int) -> list[dict]:
        """``n`` training rows (ids ``0 .. n-1``): the dataset less the held-out tail,
        shuffled by ``(self.seed, seed)``, repeated until there are ``n``.

        Raises:
            ValueError: no training rows left.
        """
        data, n_train, _, _ = self._split()
        pool = list(range(n_train))
        if not pool:
            raise ValueError(f"dataset.name={self.name!r}: its dataset has no rows for training")
        rng = random.Random(f"verifiers-train:{self.seed}:{seed}")
        order: list[int] = []
        while len(order) < n:
            rng.shuffle(pool)
            order += pool
        return [self._row(data[i], k) for k, i in enumerate(order[:n])]

    @staticmethod
    def reward(output_text: str, answer: str) -> float:
        """Always 0.0: the episodes' rewards are the environment's rubric scores (the task
        interface requires the method)."""
        return 0.0
