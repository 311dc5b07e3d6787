"""Which exceptions fail one sample and which stop the run (a bug).

A sample fails when its input or the world outside the code is at fault: the engine refuses
the request (``runtime.engines.generation.RequestRefused``: empty prompt, prompt as long as
the context, invalid sampling settings), or an env or agent raises about its data, its I/O
or its time (``ValueError``, ``KeyError``, ``RuntimeError``, ``OSError``, ``TimeoutError``,
...). The sample is left out and counted, and the failure budget
(``reward.max_failure_fraction``) stops the run only when too many fail.

A programming error is code that is wrong whatever the input: :data:`PROGRAMMING_ERRORS`
(``TypeError``, ``AttributeError``, ``NameError`` and ``UnboundLocalError``,
``AssertionError``, ``ImportError``, ``NotImplementedError``, ``SyntaxError``). Counting
it as a failed sample would hide the bug behind the budget, or, under the budget, bias
training toward the samples that do not reach the broken line; so it stops the run with
one line (:class:`ProgrammingError`) naming the node, the exception and the line that
raised it. In an env or agent it is the user's bug; in the engine, ours.
"""

from __future__ import annotations

import traceback

PROGRAMMING_ERRORS: tuple[type[BaseException], ...] = (
    TypeError, AttributeError, NameError, AssertionError, ImportError, NotImplementedError, SyntaxError)


class ProgrammingError(RuntimeError):
    """A bug (module doc) raised while producing a sample: the run stops. The message is
    one line (``brief``: the launcher prints no traceback): the node, the exception and
    ``file:line in function`` of the frame that raised it."""

    brief = True


def is_programming_error(exc: BaseException) -> bool:
    """True for an instance of :data:`PROGRAMMING_ERRORS` (a bug: the run stops)."""
    return isinstance(exc, PROGRAMMING_ERRORS)


def programming_error(where: str, exc: BaseException) -> ProgrammingError:
    """The :class:`ProgrammingError` to raise for ``exc`` caught in ``where`` (e.g.
    ``"generate node 'generate'"``); ``exc`` keeps its traceback as the cause."""
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" ({frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    error = ProgrammingError(f"{where}: {type(exc).__name__}: {exc}{at}: a programming error, "
                             "not a failed sample: the run stops")
    error.__cause__ = exc
    return error
