"""The check of a dataset config against the tasks: which ``dataset.*`` values some task takes.

Owns :func:`check_dataset`, called by ``areal_flow.config.DatasetConfig.__post_init__`` (so YAML
files, overrides, a graph's own dict and a plan's dataset node all pass here). The tasks are
``areal_flow.tasks.catalog.TASKS``, reasoning-gym datasets (``areal_flow.tasks.rgym``) and
verifiers environments (``areal_flow.envs.verifiers_env``).
"""

from __future__ import annotations

import difflib

from areal_flow.tasks.catalog import TASKS


class DatasetValueError(ValueError):
    """A ``dataset.*`` value no task takes (``areal_flow.config`` raises it as its ``ConfigError``)."""


def check_dataset(cfg) -> None:
    """Refuse dataset values no task takes (``DatasetConfig.__post_init__`` calls it, so YAML files,
    overrides, a graph's own dict and a plan's dataset node all pass here): a known ``name``, the
    keys that task reads in range, ``path`` only for gsm8k (whether the file exists is checked
    where the run starts, ``runtime.preflight``: a plan may be compiled on another machine).

    Args:
        cfg: a :class:`~areal_flow.config.DatasetConfig`.

    Raises:
        DatasetValueError: one line naming the ``dataset.<key>``, its value and what it takes.
    """
    from areal_flow.tasks.rgym import check_task, parse_name

    if isinstance(cfg.name, str) and cfg.name.startswith("verifiers:"):  # options: its load_environment arguments
        from areal_flow.envs.verifiers_env import check_spec

        try:
            check_spec(cfg.name)
        except (ValueError, ImportError) as exc:
            raise DatasetValueError(f"dataset.name: {exc}") from None
        if not isinstance(cfg.options, dict):
            raise DatasetValueError(f"dataset.options={cfg.options!r}: the environment's load_environment arguments, a mapping")
        return
    rg_name = parse_name(cfg.name)
    if rg_name is not None:
        try:
            check_task(rg_name, cfg.options)
        except (ValueError, ModuleNotFoundError) as exc:
            raise DatasetValueError(str(exc)) from None
    elif cfg.options:
        raise DatasetValueError(f"dataset.options={cfg.options!r}: only reasoning_gym:<dataset> and verifiers:<env id> "
                          "tasks take options")
    if cfg.name not in TASKS and rg_name is None:
        near = difflib.get_close_matches(str(cfg.name), TASKS, n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise DatasetValueError(f"dataset.name={cfg.name!r}: unknown task; known: {', '.join(TASKS)} "
                          f"or reasoning_gym:<dataset>{hint}")
    if not isinstance(cfg.path, str) or (cfg.path and cfg.name != "gsm8k"):
        raise DatasetValueError(f"dataset.path={cfg.path!r}: the {cfg.name} task reads no data file (only gsm8k does); "
                          "remove dataset.path")
    low, high = {"arithmetic": (1, None), "support_desk": (1, 6), "tool_multiply": (2, 4)}.get(cfg.name, (None, None))
    n = cfg.max_digits
    in_range = isinstance(n, int) and not isinstance(n, bool) and low is not None and n >= low \
        and (high is None or n <= high)
    if low is not None and not in_range:
        span = f"in {low}..{high}" if high is not None else f">= {low}"
        raise DatasetValueError(f"dataset.max_digits={n!r}: the {cfg.name} task takes an int {span}")
    if cfg.name == "arithmetic" and (not isinstance(cfg.ops, str) or not cfg.ops or set(cfg.ops) - set("+-")):
        raise DatasetValueError(f"dataset.ops={cfg.ops!r}: expected the operators to draw from: '+', '-' or '+-'")
    if cfg.name == "arithmetic" or rg_name is not None:
        if cfg.prompt_style not in ("plain", "chat"):
            raise DatasetValueError(f"dataset.prompt_style={cfg.prompt_style!r}: expected 'plain' or 'chat'")
