"""The held-out split of the tasks that generate their problems: where test ids start, how many
held-out problems training keeps out, and the check that a test set asks for no more.

Leaf module (no task imports), so every task and the config can read it.
"""

from __future__ import annotations

TEST_ID_OFFSET = 1_000_000_000
"""Held-out problem ids start here (training ids are 0, 1, 2, ...), in every task."""

HELD_OUT = 500
"""Held-out problems the generated tasks (:data:`HELD_OUT_TASKS`) keep out of training: their
``train_problems`` redraw any problem of ``test_set(HELD_OUT)``, and their ``test_set(n)`` refuses
``n > HELD_OUT``, which would score problems the policy may have trained on."""

HELD_OUT_TASKS = ("arithmetic", "support_desk", "tool_multiply")
"""The tasks that draw train and test problems from one generator (the others read separate
splits or draw from a space where a repeat is expected: ``longtail``, ``guess_number``)."""


def check_held_out(task: str, n: int, key: str = "eval.n_test") -> None:
    """Refuse a held-out set larger than the part training excludes.

    Args:
        key: the setting that asked for ``n`` problems, named in the error.

    Raises:
        ValueError: ``task`` is one of :data:`HELD_OUT_TASKS` and ``n > HELD_OUT``.
    """
    if task in HELD_OUT_TASKS and isinstance(n, int) and n > HELD_OUT:  # a mistyped n is its own check's
        raise ValueError(f"{key}={n}: the {task} task keeps only its first {HELD_OUT} held-out problems out "
                         f"of training, so a larger test set would score problems the policy trained on; "
                         f"use {key} <= {HELD_OUT}")
