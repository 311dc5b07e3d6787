"""The prompt a resampled batch slot gets: a function of the slot alone.

A group a filter drops (DAPO's dynamic sampling), or whose every sample failed, gives its
admission index a new prompt (``runtime.router``). Which prompt must not depend on when or in
which order slots were dropped, nor on what an earlier attempt of the run drew: then a
resumed run (``runtime.checkpoint``: nothing of the router is saved) and the uninterrupted
one give slot ``(index, attempt)`` the same prompt, and a checkpoint needs no stream state.

Layout: the dataset task draws spare prompts in rounds of ``n_slots * per_slot`` problems,
round ``r`` from seed ``seed + 2 + 10_000 * r``; attempt ``a >= 2`` of index ``i`` is number
``(a - 2) mod per_slot`` of the ``per_slot`` prompts reserved for ``i`` in round ``(a - 2) div per_slot``. So a slot's
attempts up to ``per_slot + 1`` (a filter's ``max_attempts``) are distinct prompts of one
round, and two slots never share a draw.
"""

from __future__ import annotations


class SparePrompts:
    """``spares(index, attempt)``: the prompt of attempt ``attempt >= 2`` of admission index
    ``index`` (module doc).

    Args:
        task: the dataset task (``train_problems(n, seed)``).
        n_slots: admission indices of the run (``train.steps * B``).
        per_slot: prompts reserved per index and round (``max_attempts - 1`` of the plan's
            filters, at least 1).
        seed: the run's seed.

    Raises:
        ValueError (on call): ``attempt < 2`` (attempt 1 is the dataset's own prompt) or an
            ``index`` outside ``[0, n_slots)``.
    """

    def __init__(self, task, n_slots: int, per_slot: int, seed: int) -> None:
        self.task, self.n_slots, self.per_slot, self.seed = task, n_slots, max(per_slot, 1), seed
        self._rounds: dict[int, list[dict]] = {}

    def __call__(self, index: int, attempt: int) -> dict:
        if attempt < 2 or not 0 <= index < self.n_slots:
            raise ValueError(f"spare prompt of index {index}, attempt {attempt}: needs attempt >= 2 and "
                             f"0 <= index < {self.n_slots}")
        round_, k = divmod(attempt - 2, self.per_slot)
        if round_ not in self._rounds:
            self._rounds[round_] = self.task.train_problems(self.n_slots * self.per_slot,
                                                            seed=self.seed + 2 + 10_000 * round_)
        return self._rounds[round_][index * self.per_slot + k]
