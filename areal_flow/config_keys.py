"""Config key names: aliases for the names AReaL and Hugging Face users type, nearest-key
suggestions by spelling and by meaning, and the listing behind ``areal-flow config``.

Owns: the alias table (``ALIASES``), its rewriting of YAML mappings and ``key=value``
overrides into our keys, the synonym table used for suggestions (``SYNONYMS``), and the
documentation of every key read from the config dataclasses' field docstrings, and
:class:`ConfigError`, the error of a bad key or value. Must not:
validate values (``areal_flow.config`` does) or act on the config.

An alias is rewritten before the config is merged, so ``training.seed: 3`` in a YAML file
and ``training.seed=3`` on the command line both set ``seed``; an error about the value
still names the key as the user wrote it only through its line number (YAML) or the
``command line``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Callable


class ConfigError(ValueError):
    """A bad config key or value; the message names the key, its source and the fix."""


def _precision(dtype: str) -> Callable[[Any], str | None]:
    """``true`` -> ``dtype``; ``false`` -> no change (None)."""

    def convert(value: Any) -> str | None:
        if str(value).lower() in ("true", "1", "yes"):
            return dtype
        if str(value).lower() in ("false", "0", "no"):
            return None
        raise ValueError(f"expected true or false, got {value!r}")

    return convert


def _tristate(value: Any) -> bool | None:
    """``true``/``false`` -> that boolean; ``auto`` (or ``null``) -> no change (None): the default, auto."""
    text = str(value).lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    if text in ("auto", "null", "none"):
        return None
    raise ValueError(f"expected true, false or auto, got {value!r}")


@dataclass(frozen=True)
class Alias:
    """``name`` (theirs) sets ``target`` (ours), through ``convert`` when given (None = drop)."""

    name: str
    target: str
    origin: str
    """Where users know the name from."""
    convert: Callable[[Any], Any] | None = None
    note: str = ""


ALIASES: tuple[Alias, ...] = (
    Alias("training.seed", "seed", "HF TrainingArguments"),
    Alias("training.bf16", "model.dtype", "HF TrainingArguments", _precision("bfloat16"), "true -> bfloat16"),
    Alias("training.fp16", "model.dtype", "HF TrainingArguments", _precision("float16"), "true -> float16"),
    Alias("training.gradient_accumulation_steps", "train.gradient_accumulation_steps", "HF TrainingArguments",
          note="micro-batches per DP rank of each train_step, as the plan records"),
    Alias("training.warmup_steps", "train.lr_warmup_steps", "HF TrainingArguments"),
    Alias("model.activation_checkpointing", "compile.activation_checkpointing", "torchtitan", _tristate,
          "true = on, false = off, auto = the compiler decides"),
    Alias("actor.gradient_checkpointing", "compile.activation_checkpointing", "AReaL", _tristate,
          "true = on, false = off, auto = the compiler decides"),
    Alias("experiment_name", "name", "AReaL"),
    Alias("allocation_mode", "compile.allocation", "AReaL"),
    Alias("cluster.fileroot", "out_dir", "AReaL"),
    Alias("actor.path", "model.path", "AReaL"),
    Alias("actor.optimizer.lr", "train.lr", "AReaL"),
    Alias("actor.optimizer.weight_decay", "train.weight_decay", "AReaL"),
    Alias("actor.optimizer.gradient_clipping", "train.max_grad_norm", "AReaL"),
    Alias("train_dataset.path", "dataset.path", "AReaL"),
    Alias("train_dataset.batch_size", "train.batch_size", "AReaL"),
    Alias("gconfig.n_samples", "gen.n_samples", "AReaL"),
    Alias("gconfig.max_new_tokens", "gen.max_new_tokens", "AReaL"),
    Alias("gconfig.temperature", "gen.temperature", "AReaL"),
    Alias("rollout.max_head_offpolicyness", "async.max_staleness", "AReaL"),
    Alias("compile.prompts_per_step", "train.batch_size", "areal-flow (its old name)",
          note="B, prompt groups per train step, has one key"),
)
ALIAS_BY_NAME = {a.name: a for a in ALIASES}

SYNONYMS: dict[str, tuple[str, ...]] = {
    "learning_rate": ("lr",), "lr": ("lr",), "step_size": ("lr",),
    "batch": ("batch_size",), "bsz": ("batch_size",), "train_batch_size": ("batch_size",),
    "epochs": ("steps",), "num_epochs": ("steps",), "total_train_epochs": ("steps",), "max_steps": ("steps",),
    "num_steps": ("steps",), "iterations": ("steps",), "total_steps": ("steps",),
    "group_size": ("n_samples",), "num_samples": ("n_samples",), "num_generations": ("n_samples",),
    "max_tokens": ("max_new_tokens",), "max_length": ("max_new_tokens",), "max_completion_length": ("max_new_tokens",),
    "warmup_steps": ("lr_warmup_steps",), "num_warmup_steps": ("lr_warmup_steps",),
    "temp": ("temperature",), "wd": ("weight_decay",),
    "grad_clip": ("max_grad_norm",), "clip_grad_norm": ("max_grad_norm",), "gradient_clipping": ("max_grad_norm",),
    "precision": ("dtype",), "torch_dtype": ("dtype",),
    "model_name": ("path",), "model_path": ("path",), "name_or_path": ("path",), "data_path": ("path",),
    "staleness": ("max_staleness",), "max_head_offpolicyness": ("max_staleness",), "off_policyness": ("max_staleness",),
    "gpus": ("n_gpus_per_node",), "gpus_per_node": ("n_gpus_per_node",), "nodes": ("n_nodes",), "num_nodes": ("n_nodes",),
    "random_seed": ("seed",), "gradient_checkpointing": ("activation_checkpointing",),
}
"""Our leaf names a user's leaf name means (lower-case), tried before spelling."""


WORDS = {"compile.activation_checkpointing": _tristate}
"""Keys of ours whose values may be words their type cannot parse (``auto`` for a ``bool | None``),
converted as their aliases' are."""


def _words(key: str, value: Any, where: str = "") -> Any:
    """``value`` of our ``key`` through :data:`WORDS`' conversion (unchanged for other keys)."""
    try:
        return WORDS[key](value) if key in WORDS else value
    except ValueError as exc:
        raise ValueError(f"{where}{key}: {exc}") from None


def rewrite_override(key: str, value: str) -> list[tuple[str, str]]:
    """One ``key=value`` override -> ``[(our_key, value)]`` (empty when the alias drops it).

    Raises:
        ValueError: the alias's conversion rejects ``value`` (message names the alias).
    """
    alias = ALIAS_BY_NAME.get(key)
    if alias is None and key in WORDS:
        converted = _words(key, value)
        return [(key, "null" if converted is None else str(converted).lower())]
    if alias is None:
        return [(key, value)]
    converted = _convert(alias, value)
    return [] if converted is None else [(alias.target, str(converted))]


def rewrite_mapping(data: dict, lines: dict[str, int]) -> dict:
    """A YAML mapping with alias keys moved to their targets (in place, returned); ``lines``
    (dotted key -> line) gains the targets' lines so errors point at the alias's line.

    Raises:
        ValueError: a conversion rejects a value, naming the alias and its line.
    """
    for alias in ALIASES:
        found, value = _pop(data, alias.name.split("."))
        if not found:
            continue
        line = lines.get(alias.name)
        try:
            converted = _convert(alias, value)
        except ValueError as exc:
            raise ValueError(f"line {line}: {exc}" if line else str(exc)) from None
        if converted is not None:
            _put(data, alias.target.split("."), converted)
            if line is not None:
                lines[alias.target] = line
    for key in WORDS:
        found, value = _pop(data, key.split("."))
        if found:
            line = lines.get(key)
            _put(data, key.split("."), _words(key, value, f"line {line}: " if line else ""))
    return data


def suggest(key: str, valid: list[str]) -> str | None:
    """The valid key a mistyped ``key`` most likely means: an alias's target, then a
    synonym of its last part (same section first), then the closest spelling (difflib
    ratio >= 0.5); None when nothing is close.

    >>> suggest("train.learning_rate", ["train.lr", "train.weight_decay"])
    'train.lr'
    """
    if key in ALIAS_BY_NAME:
        return ALIAS_BY_NAME[key].target
    prefix, _, leaf = key.rpartition(".")
    for ours in SYNONYMS.get(leaf.lower(), ()):
        same_section = f"{prefix}.{ours}" if prefix else ours
        if same_section in valid:
            return same_section
        elsewhere = [k for k in valid if k.rpartition(".")[2] == ours]
        if elsewhere:
            return elsewhere[0]
    near = difflib.get_close_matches(key, valid + list(ALIAS_BY_NAME), n=1, cutoff=0.5)
    if not near:
        return None
    return ALIAS_BY_NAME[near[0]].target if near[0] in ALIAS_BY_NAME else near[0]


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it (attribute docstrings, PEP 257);
    read from the class source with ``ast``; fields without one are absent."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe_keys(schema: type) -> list[tuple[str, str, str, str]]:
    """Every leaf key of ``schema`` as ``(dotted key, type, default, docstring)``; the
    field ``async_`` is listed as ``async``."""
    rows = []

    def walk(cls: type, prefix: str) -> None:
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            name = "async" if f.name == "async_" else f.name
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{prefix}{name}.")
                continue
            kind = hints.get(f.name)
            rows.append((prefix + name, getattr(kind, "__name__", str(kind).replace("typing.", "")),
                         repr(default), docs.get(f.name, "")))

    walk(schema, "")
    return rows


def format_listing(schema: type) -> str:
    """The text of ``areal-flow config``: every key (type, default, docstring), then the
    alias table."""
    out = ["keys (set in YAML or as key=value on the command line):", ""]
    for key, kind, default, doc in describe_keys(schema):
        out.append(f"  {key}: {kind} = {default}")
        if doc:
            out.append(f"      {doc}")
    out += ["", "aliases (names from other tools; they set our key):", ""]
    for a in ALIASES:
        out.append(f"  {a.name:40s} -> {a.target:35s} ({a.origin}{'; ' + a.note if a.note else ''})")
    return "\n".join(out)


def _convert(alias: Alias, value: Any) -> Any:
    if alias.convert is None:
        return value
    try:
        return alias.convert(value)
    except ValueError as exc:
        raise ValueError(f"{alias.name} (alias of {alias.target}): {exc}") from None


def _pop(data: Any, parts: list[str]) -> tuple[bool, Any]:
    if not isinstance(data, dict) or parts[0] not in data:
        return False, None
    if len(parts) == 1:
        return True, data.pop(parts[0])
    found, value = _pop(data[parts[0]], parts[1:])
    if found and data[parts[0]] == {}:
        del data[parts[0]]
    return found, value


def _put(data: dict, parts: list[str], value: Any) -> None:
    for part in parts[:-1]:
        data = data.setdefault(part, {})
    data[parts[-1]] = value
