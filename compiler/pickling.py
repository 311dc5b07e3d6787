"""Pickles of graph-file code that keep their file names.

A graph file is loaded under a made-up module name, so what it defines (a reward function,
an agent, a user op) reaches the workers by value through cloudpickle
(``compiler.plan.encode_value``). cloudpickle replaces each code object's file name with
``<dynamic-code>`` (so a payload does not depend on where its code was defined); a
traceback raised in a worker then names no file. :func:`dumps` keeps the file, written as
the plan's node sources are (relative to the working directory when below it), so the
traceback shows the graph file's line and its text.
"""

from __future__ import annotations

import io
import os
import types
from collections import ChainMap

import cloudpickle

_DYNAMIC = "<dynamic-code>"


def shown_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute (as
    ``areal_flow.dsl.user_source`` names a graph file)."""
    path = os.path.abspath(path)
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _code_reducer():
    """cloudpickle's code reducer with the file name put back; None when this cloudpickle has
    no ``_code_reduce`` (its pickles then name no file)."""
    reduce_code = getattr(cloudpickle.cloudpickle, "_code_reduce", None)
    if reduce_code is None:
        return None

    def reduce(code: types.CodeType):
        make, args = reduce_code(code)
        name = shown_path(code.co_filename) if not code.co_filename.startswith("<") else code.co_filename
        return make, tuple(name if isinstance(a, str) and a == _DYNAMIC else a for a in args)

    return reduce


def dumps(value) -> bytes:
    """``cloudpickle.dumps(value)``, each code object keeping its file name (module doc)."""
    reduce = _code_reducer()
    if reduce is None:
        return cloudpickle.dumps(value)

    class KeepFileNames(cloudpickle.Pickler):
        dispatch_table = ChainMap({types.CodeType: reduce}, cloudpickle.Pickler.dispatch_table)

    buffer = io.BytesIO()
    KeepFileNames(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(value)
    return buffer.getvalue()
