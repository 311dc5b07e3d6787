"""Tool calls: parse a policy turn into a validated call of one of an env's tools.

Two spellings are accepted (``tools`` in the OpenAI function schema, ``[{"type": "function",
"function": {"name", "description", "parameters"}}]``):

* Hermes / Qwen: ``<tool_call>{"name": "refund", "arguments": {"order": 4821}}</tool_call>``
  anywhere in the turn (what chat-template models emit; text around it is ignored);
* call syntax: the whole turn is ``refund(4821)`` or ``refund(order=4821)`` (what the
  character model emits); positional arguments follow the order of the tool's
  ``parameters.properties``; a bare word is a string (``lookup(abc)`` -> ``"abc"``), and so
  is any other argument that is not a Python literal: its source text
  (``python(print(6*7))`` -> ``"print(6*7)"``, what a model without quote characters in
  its vocabulary writes).

Arguments are checked against the schema (known tool, required present, no extras) and
``"integer"`` / ``"number"`` / ``"string"`` values coerced (``"4821"`` <-> ``4821``).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

NOT_A_CALL = "no tool call"
"""``ToolCallError.reason`` of a turn that attempts no call at all (plain text)."""

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_CALL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\s*\(.*\)", re.S)


@dataclass
class ToolCall:
    """A validated call: ``name`` is a known tool, ``arguments`` maps parameter names to coerced values."""

    name: str
    arguments: dict = field(default_factory=dict)


@dataclass
class ToolCallError:
    """A turn that is not a valid call: ``text`` is the turn, ``reason`` says why (one line);
    ``NOT_A_CALL`` (``is_call_attempt`` False) when it has no ``<tool_call>`` and no ``(``."""

    text: str
    reason: str

    @property
    def is_call_attempt(self) -> bool:
        return self.reason != NOT_A_CALL


def tool_names(tools: list[dict] | None) -> list[str]:
    """The names of an OpenAI-schema tool list, in order (``[]`` for ``None``)."""
    return [t.get("function", t).get("name", "") for t in tools or []]


def _schema(tools: list[dict] | None, name: str) -> dict | None:
    for t in tools or []:
        fn = t.get("function", t)
        if fn.get("name") == name:
            return fn.get("parameters") or {}
    return None


def _coerce(value, kind: str | None):
    """``value`` as JSON-schema type ``kind`` (other kinds pass through); raises ValueError."""
    ok = not isinstance(value, (bool, dict, list))
    try:
        if kind == "integer" and ok and (isinstance(value, str) or float(value).is_integer()):
            return int(value)
        if kind == "number" and ok:
            return float(value)
    except (ValueError, TypeError, OverflowError):
        pass
    if kind == "string" and not isinstance(value, (dict, list)):
        return str(value)
    if kind in ("integer", "number", "string"):
        raise ValueError(f"{value!r} is not of type {kind}")
    return value


def _literal(node: ast.expr, source: str):
    """A literal's value; any other expression is its source text: a bare word
    (``lookup(abc)`` -> ``"abc"``) or code (``python(print(6*7))`` -> ``"print(6*7)"``)."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return ast.get_source_segment(source, node)


def _from_call_syntax(text: str) -> tuple[str, list, dict]:
    """``name(a, b, key=c)`` -> ``(name, [a, b], {key: c})``; raises ValueError / SyntaxError."""
    source = text.strip()
    tree = ast.parse(source, mode="eval").body
    if not isinstance(tree, ast.Call) or not isinstance(tree.func, ast.Name):
        raise ValueError("expected name(arguments)")
    keys = [k.arg for k in tree.keywords]
    if None in keys or len(set(keys)) < len(keys) or any(isinstance(a, ast.Starred) for a in tree.args):
        raise ValueError("*args, **kwargs or a repeated keyword")
    return (tree.func.id, [_literal(a, source) for a in tree.args],
            {k.arg: _literal(k.value, source) for k in tree.keywords})


def _validate(text: str, tools: list[dict] | None, name: str, args: list, kwargs: dict) -> ToolCall | ToolCallError:
    schema = _schema(tools, name)
    if schema is None:
        return ToolCallError(text, f"unknown tool {name}, known tools {', '.join(tool_names(tools)) or 'none'}")
    props = dict(schema.get("properties") or {})
    if len(args) > len(props):
        return ToolCallError(text, f"{name} takes {len(props)} arguments, got {len(args)}")
    values = dict(zip(props, args))
    for key, value in kwargs.items():
        if key in values:
            return ToolCallError(text, f"{name} got argument {key} twice")
        values[key] = value
    extra = [k for k in values if k not in props]
    if extra:
        return ToolCallError(text, f"{name} has no argument {', '.join(extra)}")
    missing = [k for k in schema.get("required", []) if k not in values]
    if missing:
        return ToolCallError(text, f"{name} needs argument {', '.join(missing)}")
    try:
        values = {k: _coerce(v, props[k].get("type")) for k, v in values.items()}
    except ValueError as exc:
        return ToolCallError(text, f"{name} bad argument, {exc}")
    return ToolCall(name, values)


def parse_tool_call(text: str, tools: list[dict] | None) -> ToolCall | ToolCallError:
    """Parse one policy turn against ``tools``; never raises. Returns a :class:`ToolCall`
    (the first Hermes block, else the call syntax) or a :class:`ToolCallError` whose reason
    is ``NOT_A_CALL``, bad JSON / syntax, an unknown tool (known ones listed), a missing /
    extra / repeated argument, or a value of the wrong type."""
    text = str(text)
    hermes = _HERMES.search(text)
    if hermes:
        try:
            obj = json.loads(hermes.group(1).strip())
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ToolCallError(text, "tool call json needs a name")
            arguments = obj.get("arguments", obj.get("parameters", {}))
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments  # JSON-encoded
            if not isinstance(arguments, dict):
                return ToolCallError(text, "tool call arguments must be an object")
        except (json.JSONDecodeError, RecursionError):
            return ToolCallError(text, "tool call is not valid json")
        return _validate(text, tools, obj["name"], [], arguments)
    if "(" not in text:
        return ToolCallError(text, NOT_A_CALL)
    try:
        if not _CALL.fullmatch(text.strip()):
            raise ValueError("not name(...)")
        name, args, kwargs = _from_call_syntax(text)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return ToolCallError(text, "malformed call, expected name(arguments)")
    return _validate(text, tools, name, args, kwargs)
