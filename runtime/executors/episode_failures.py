"""Failed episodes of a rollout, summarized: one line per distinct error, with counts.

Owns how an episode's failure (its env or agent raised, or took more than
``step_timeout_s``) is described and reported; ``runtime.executors.episode_runner`` decides when
an episode failed. A distinct error is an exception type raised at one place of the
user's code (the innermost frame in the env's or agent's file, else the innermost frame);
its line reads ``APITimeoutError: Request timed out. (graphs/agent.py:33 in agent)``. The
first episode of each distinct error prints that one line on stderr and appends its whole
traceback to the log file (the run folder's ``episode_failures.log``), so a run of many
failures stays readable and nothing is lost; :attr:`EpisodeFailures.counts` counts the
failed episodes of each line, which the run summary shows (``runtime.metrics``).
"""

from __future__ import annotations

import inspect
import os
import sys
import traceback
from collections import Counter
from pathlib import Path

LOG_NAME = "episode_failures.log"
"""The file in the run folder that holds the first traceback of each distinct error."""

MAX_MESSAGE = 160
"""Characters of an error's message a summary line keeps."""


def _code_file(fn) -> str | None:
    """The source file of the user's env class or agent function (None when it has none)."""
    try:
        return os.path.abspath(inspect.getfile(fn))
    except (TypeError, OSError):
        return None


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if rel.startswith("..") else rel


class EpisodeFailures:
    """The failures of one rollout's episodes (module doc).

    Args:
        who: the rollout's episode code as the user names it (``agent solve``, ``env 'guess'``).
        code: the env class or agent function; the frame of an error shown is in its file.
        log: where the first traceback of each distinct error is appended (None: nowhere,
            the one line only).
    """

    def __init__(self, who: str, code, log: Path | None = None) -> None:
        self.who, self.home, self.log = who, _code_file(code), log
        self.counts: Counter[str] = Counter()
        self._lines: dict[tuple[str, str], str] = {}

    def error(self, exc: BaseException) -> str:
        """The summary line of ``exc`` (raised by an episode's code); reported when it is new."""
        frames = traceback.extract_tb(exc.__traceback__)
        here = [f for f in frames if self.home and os.path.abspath(f.filename) == self.home] or frames[-1:]
        where = f"{_shown(here[-1].filename)}:{here[-1].lineno} in {here[-1].name}" if here else "unknown place"
        message = (str(exc).strip().splitlines() or [""])[0]
        message = message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE - 3] + "..."
        line = f"{type(exc).__name__}: {message} ({where})"
        return self._note((type(exc).__name__, where), line, "".join(traceback.format_exception(exc)))

    def timeout(self, message: str) -> str:
        """The summary line of an episode that took too long (``message``: the one line)."""
        return self._note(("TimeoutError", "step_timeout_s"), message, message + "\n")

    def count(self, line: str) -> None:
        """One more failed episode of ``line`` (when its group ends, as ``episodes_failed``)."""
        self.counts[line] += 1

    def _note(self, key: tuple[str, str], line: str, detail: str) -> str:
        if key in self._lines:
            return self._lines[key]
        self._lines[key] = line
        where = ""
        if self.log is not None:
            try:
                with open(self.log, "a") as fh:
                    fh.write(f"=== rollout {self.who}: {line}\n{detail}\n")
                where = f" (traceback: {self.log})"
            except OSError as exc:  # an unwritable log must not fail the episode's group
                where = f" (its traceback could not be written to {self.log}: {exc})"
        print(f"areal-flow: rollout {self.who}: an episode failed: {line}; it is left out of its group; later "
              f"failures like it are counted in the run summary{where}", file=sys.stderr)
        return line
