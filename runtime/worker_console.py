"""A local worker's messages on the driver's terminal, not glued to its progress bar.

The driver draws its progress bar (``tqdm``, ``runtime.metrics``) on the terminal's last line
and redraws it in place; a local worker process writes to the same terminal (its stderr is
the driver's), so a worker's line used to continue the bar's line (``rl: 25%|...| 1/4
[...]generate 'generate' replica 0: gen.dtype=auto chose bfloat16 ...``). In a worker whose
stderr is a terminal, :func:`clear_bar_before_lines` makes every line it starts first clear
that line (``\\r`` and ``ESC[K``, erase to the end of the line), so the message takes the line
whole and the bar redraws under it at its next refresh, as ``tqdm.write`` does in the
driver. A stderr that is not a terminal (a log file, a pipe, a test) is left as it is.
"""

from __future__ import annotations

import sys

CLEAR_LINE = "\r\x1b[K"


class LineClearingStream:
    """``stream`` with :data:`CLEAR_LINE` written before every line's first character."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.at_line_start = True

    def write(self, text: str) -> int:
        if not text:
            return 0
        lines = text.split("\n")
        out = [(CLEAR_LINE if line and (i or self.at_line_start) else "") + line for i, line in enumerate(lines)]
        self.at_line_start = text.endswith("\n")
        self.stream.write("\n".join(out))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def clear_bar_before_lines() -> None:
    """In a worker process: wrap ``sys.stderr`` in :class:`LineClearingStream` when it is a terminal."""
    if sys.stderr is not None and sys.stderr.isatty() and not isinstance(sys.stderr, LineClearingStream):
        sys.stderr = LineClearingStream(sys.stderr)
