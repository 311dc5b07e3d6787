"""The JSON types of a plan read from disk, checked against the plan dataclasses' annotations
before any of them is built.

Owns the rule that a hand edit giving a field a value of the wrong JSON type (a string for
an int, a list for a name, a number for a node) is refused naming the field's path, e.g.
``plan node 'generate': mesh.n_devices='2' is not int``, instead of surfacing later as a
``TypeError`` deep in the compiler or the simulator. Only the plan's own fields are
checked: free-form mappings (``attrs``, ``times``, ``workload``...) are checked by their
readers. ``Plan.from_dict`` calls :func:`check_json_types`; must not build a plan.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union


def fits(value: Any, hint: Any) -> bool:
    """Whether a JSON ``value`` can stand for a field annotated ``hint`` (dataclasses: any mapping)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint in (list, tuple) or origin in (list, tuple):
        return isinstance(value, (list, tuple))  # JSON lists; Plan.to_dict() keeps tuples
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    return True


def type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def check_fields(data: Any, cls: type, where: str, error, prefix: str = "") -> None:
    """Raise ``error(message)`` naming ``where`` and the dotted field when a field of ``data``
    (a mapping read as dataclass ``cls``) has the wrong JSON type; nested dataclasses and
    ``tuple[Dataclass, ...]`` fields are checked in turn."""
    if not isinstance(data, dict):
        raise error(f"{where}: {prefix.rstrip('.') or 'entry'}={data!r:.60} must be a mapping")
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        if name not in hints:
            continue  # unknown fields: the dataclass constructor names them
        hint = hints[name]
        if not fits(value, hint):
            raise error(f"{where}: {prefix}{name}={value!r:.60} is not {type_name(hint)}")
        inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(hint):
            inner = [hint]
        if inner and isinstance(value, dict):
            check_fields(value, inner[0], where, error, f"{prefix}{name}.")


def check_json_types(data: dict, classes: dict[str, type], plan_cls: type, error) -> None:
    """Check a plan mapping: its top-level fields against ``plan_cls``, and each entry of the
    lists named in ``classes`` (``{"nodes": NodePlan, ...}``) against its class.

    Raises:
        ``error``: ``"plan: step_time_s='x' is not float"``, ``"plan node 'generate':
        mesh.n_nodes='1' is not int"``, ``"plan edges[2]: src=['a'] is not str"``.
    """
    top = {k: v for k, v in data.items() if k not in classes}
    check_fields(top, plan_cls, "plan", error)
    for key, cls in classes.items():
        entries = data.get(key, [])
        if not isinstance(entries, (list, tuple)):
            raise error(f"plan: {key}={entries!r:.60} must be a list")
        for i, entry in enumerate(entries):
            name = entry.get("name") if isinstance(entry, dict) and key == "nodes" else None
            where = f"plan node {name!r}" if isinstance(name, str) else f"plan {key}[{i}]"
            check_fields(entry, cls, where, error)
    cluster = data.get("cluster")
    for key in ("n_nodes", "n_gpus_per_node"):
        value = cluster.get(key) if isinstance(cluster, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise error(f"plan: cluster.{key}={value!r} must be an int >= 1")
