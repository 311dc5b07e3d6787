"""Loading an experiment config: YAML files and dotted overrides into the typed schema.

Parsing and type conversion are OmegaConf's (structured configs over the dataclasses of
``areal_flow.config``); this module adds what users need from the errors: the dotted key,
the YAML file and line it came from (or "command line"), the expected type, and the
nearest valid key for a typo (by meaning, ``learning_rate`` -> ``lr``, or spelling). It
must not act on the config.

A YAML file may start from another one: ``base: arith_grpo.yaml`` (a path relative to
the file) loads that file first and then merges this file's keys over it, so a graph's
config lists only what differs from the job it is based on. Bases may chain; a cycle is
an error. (OmegaConf/Hydra ``defaults:`` lists are not supported: one base, no groups.)
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from areal_flow.config import ConfigError, ExperimentConfig
from areal_flow.config_keys import rewrite_mapping, rewrite_override, suggest


def yaml_key(key: str) -> str:
    return key.replace("async_", "async")


def config_yaml(cfg: Any) -> str:
    """``cfg`` (an ``ExperimentConfig``) as YAML, every key at its resolved value, as users write
    the keys (``async``): what ``areal-flow config`` prints, and :func:`load_config` reads it back."""
    data = {yaml_key(k): v for k, v in dataclasses.asdict(cfg).items()}
    return yaml.safe_dump(data, sort_keys=False)


def _field_key(key: str) -> str:
    parts = key.split(".")
    return ".".join("async_" if p == "async" else p for p in parts)


def _line_index(path: Path) -> dict[str, int]:
    """Dotted key -> 1-based line in the YAML file, from PyYAML's node marks.

    Raises:
        ConfigError: a key written twice in one mapping (PyYAML keeps the last silently; both lines named).
    """
    index: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
                if key in index:
                    raise ConfigError(f"{path}:{key_node.start_mark.line + 1}: '{key}' is written twice (first on "
                                      f"line {index[key]}); YAML would keep only this one: merge them into one")
                index[key] = key_node.start_mark.line + 1
                walk(value_node, key)

    with path.open() as fh:
        walk(yaml.compose(fh), "")
    return index


def all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            keys.extend(all_keys(type(sub), f"{prefix}{f.name}."))
    return keys


def _rename_async(data: Any) -> Any:
    if isinstance(data, dict):
        return {("async_" if k == "async" else k): _rename_async(v) for k, v in data.items()}
    return data


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    schema: type = ExperimentConfig,
) -> Any:
    """Build a typed config from a YAML file and ``key=value`` overrides.

    Args:
        path: YAML file (optional); its ``base`` chain is merged first (module doc).
        overrides: dotted ``key=value`` strings, applied after the file.
        schema: the root dataclass.

    Returns:
        An instance of ``schema``.

    Raises:
        ConfigError: unknown key (with the nearest valid key), wrong type (with the
            expected type), malformed override or YAML; naming the key and its source
            (``file:line`` or ``command line``).
    """
    base = OmegaConf.structured(schema)
    layers: list[tuple[Any, str, dict[str, int]]] = [] if path is None else _file_layers(Path(path), [])
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} (command line): expected key=value, e.g. train.lr=1e-4")
        key, value = item.split("=", 1)
        try:
            pairs = rewrite_override(key, value)
        except ValueError as exc:
            raise ConfigError(f"{exc} (command line)") from None
        for key, value in pairs:
            layers.append((_override_layer(key, value), "command line", {}))

    merged = base
    for layer, source, lines in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as exc:
            raise _explain(exc, source, lines, schema, layer) from None
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _explain(exc, "config", {}, schema) from None
    except ConfigError as exc:  # a value check of the schema (its __post_init__): say where the value came from
        raise ConfigError(_with_source(str(exc), layers)) from None


def _with_source(message: str, layers: list[tuple[Any, str, dict[str, int]]]) -> str:
    """``message`` of a value check (``"<dotted key>=<value>: ..."``) prefixed with where that key was
    set last: ``file:line`` or ``command line``; unchanged when it names no key or no layer set it
    (a default value)."""
    key = message.split("=", 1)[0]
    if not key or not all(part.isidentifier() for part in key.split(".")):
        return message
    for layer, source, lines in reversed(layers):
        if OmegaConf.select(layer, _field_key(key), default=None) is not None:
            return f"{source}:{lines[key]}: {message}" if key in lines else f"{message} ({source})"
    return message


def _override_layer(key: str, value: str) -> Any:
    """One ``key=value`` override as a config layer; the value is read as YAML (``1e-4`` a
    float, ``[a, b]`` a list), as OmegaConf reads dotlists.

    Raises:
        ConfigError: the value is not YAML (``dataset.ops=*``: ``*`` starts an alias), naming
            the override and how to pass it as a string.
    """
    if value == "" and key_type(key) is str:  # `name=`: the empty string (a dotlist reads it as null)
        return OmegaConf.from_dotlist([f"{_field_key(key)}=''"])
    try:
        return OmegaConf.from_dotlist([f"{_field_key(key)}={value}"])
    except yaml.YAMLError as exc:
        parts = [getattr(exc, "context", None), getattr(exc, "problem", None)]
        problem = " ".join(": ".join(str(p) for p in parts if p).split()) or str(exc).splitlines()[0]
        raise ConfigError(f"override '{key}={value}' (command line): {value!r} is not a YAML value ({problem}); "
                          f"""quote it to pass it as a string: {key}='"{value}"'""") from None


def key_type(key: str, schema: type = ExperimentConfig) -> Any:
    """The annotation of the dotted config ``key`` (as users write it: ``async.max_staleness``),
    e.g. ``float`` for ``train.lr``; None when ``schema`` has no such key."""
    cls: Any = schema
    for part in _field_key(key).split("."):
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            return None
        cls = hints[part]
    return cls


def config_from_values(values: dict[str, Any], schema: type = ExperimentConfig) -> Any:
    """An instance of ``schema`` with the dotted ``values`` set (already of their keys' types,
    e.g. read from a plan, ``compiler.lowering.config_values``) and every other key at its
    default, built so that the schema's own checks (``__post_init__``) run on them as on a
    loaded config: one check of a value, whichever source it came from.

    Raises:
        ConfigError: a check refuses a value (its message names the key).
        KeyError: a key ``schema`` lacks (callers pass known keys).
    """
    nested: dict[str, Any] = {}
    for key, value in values.items():
        *sections, leaf = _field_key(key).split(".")
        target = nested
        for section in sections:
            target = target.setdefault(section, {})
        target[leaf] = value

    def build(cls: type, data: dict) -> Any:
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for name, value in data.items():
            if name not in hints:
                raise KeyError(f"{cls.__name__} has no field {name!r}")
            kwargs[name] = build(hints[name], value) if dataclasses.is_dataclass(hints[name]) else value
        return cls(**kwargs)

    return build(schema, nested)


def _yaml_error(path: Path, exc: yaml.YAMLError) -> str:
    """One line: ``<file>:<line>:<column>: invalid YAML: <problem>`` (PyYAML's marks are 0-based)."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
    return f"{where}: invalid YAML: {problem}"


def _file_layers(path: Path, chain: list[Path]) -> list[tuple[Any, str, dict[str, int]]]:
    """The merge layers of one YAML file: its ``base`` chain first, then the file itself.

    Raises:
        ConfigError: missing file, invalid YAML, a non-mapping top level, a ``base`` that
            is not a string, or a cycle of bases (naming the files).
    """
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" + (f" (base of {chain[-1]})" if chain else ""))
    if path.resolve() in [p.resolve() for p in chain]:
        raise ConfigError(f"config base cycle: {' -> '.join(str(p) for p in chain + [path])}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_error(path, exc)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    lines = _line_index(path)
    layers = []
    if "base" in data:
        parent = data.pop("base")
        if not isinstance(parent, str) or not parent:
            raise ConfigError(f"{path}:{lines.get('base', '?')}: 'base' must be a YAML file path, got {parent!r}")
        layers = _file_layers(path.parent / parent, chain + [path])
    try:
        data = rewrite_mapping(data, lines)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return layers + [(OmegaConf.create(_rename_async(data)), str(path), lines)]


def _explain(exc: OmegaConfBaseException, source: str, lines: dict[str, int], schema: type,
             layer: Any = None) -> ConfigError:
    key = yaml_key(str(getattr(exc, "full_key", "") or "")) or _scalar_section(layer, schema)
    where = f"{source}:{lines[key]}" if key in lines else source
    if isinstance(exc, ConfigKeyError):
        near = suggest(key, [yaml_key(k) for k in all_keys(schema)])
        hint = f"; did you mean '{near}'?" if near else ""
        return ConfigError(f"unknown config key '{key}' ({where}){hint}")
    message = str(exc).splitlines()[0]
    expected = _expected_type(schema, key)
    if expected == "list" and "is not a ListConfig" in message:  # e.g. debug.kill_at=generate/0:...
        return ConfigError(f"config key '{key}' ({where}) takes a list, even of one entry: {key}=[...]")
    return ConfigError(f"config key '{key}' ({where}): {message}" + (f"; expected {expected}" if expected else ""))


def _scalar_section(layer: Any, schema: type, prefix: str = "") -> str:
    """The first key of ``layer`` (dotted, at any depth) that is a section of ``schema`` given
    a scalar (OmegaConf's merge error then names no key), or ``""``."""
    if layer is None or not OmegaConf.is_dict(layer):
        return ""
    hints = typing.get_type_hints(schema)
    for key in layer.keys():
        field = _field_key(str(key))
        if dataclasses.is_dataclass(hints.get(field)):
            node = layer._get_node(key)
            found = _scalar_section(node, hints[field], f"{prefix}{field}.") if OmegaConf.is_dict(node) \
                else yaml_key(prefix + field)
            if found:
                return found
    return ""


def _expected_type(schema: type, key: str) -> str:
    hint = key_type(key, schema) if key else None
    return "" if hint is None else getattr(hint, "__name__", str(hint))
