"""A local worker's lines on the driver's terminal clear the progress bar's line first
(runtime.worker_console). Expected bytes written by hand."""

from __future__ import annotations

import io
import sys

from runtime.worker_console import LineClearingStream, clear_bar_before_lines

CLEAR = "\r\x1b[K"


def test_every_line_a_worker_starts_clears_the_terminal_line_first():
    sink = io.StringIO()
    out = LineClearingStream(sink)
    out.write("a\nb\n")
    out.write("par")
    out.write("tial\n")
    out.write("\n")  # an empty line clears nothing
    assert sink.getvalue() == f"{CLEAR}a\n{CLEAR}b\n{CLEAR}partial\n\n"
    assert out.getvalue() == sink.getvalue()  # everything else is the stream's own


def test_only_a_terminal_stderr_is_wrapped(monkeypatch):
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    clear_bar_before_lines()
    assert sys.stderr is pipe  # a log file or a pipe keeps its bytes
    tty = io.StringIO()
    tty.isatty = lambda: True
    monkeypatch.setattr(sys, "stderr", tty)
    clear_bar_before_lines()
    clear_bar_before_lines()  # once only
    assert isinstance(sys.stderr, LineClearingStream) and sys.stderr.stream is tty
    print("generate 'generate' replica 0: gen.dtype=auto chose bfloat16", file=sys.stderr)
    assert tty.getvalue() == f"{CLEAR}generate 'generate' replica 0: gen.dtype=auto chose bfloat16\n"
