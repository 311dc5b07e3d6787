"""What a run checks before its folder is touched: the checks that need the run's machine.

Owns :func:`preflight`, which ``runtime.run_setup.RunSetup.create`` calls before it moves an
earlier run aside or writes ``plan.json``, for every way a run starts (a graph file with its
YAML and overrides, a hand-edited ``plan.json``, either scheduler): the plan's config values
with the config's own checks, the generators' sampling attributes and, on the local scheduler,
that vLLM imports where a generator asks for it, and the dataset's task with what the
models need of it. A bad input is refused with one line and nothing written; the
plan's structure and JSON types were checked when it was read (``compiler.plan_check``).
It also owns :func:`check_runnable`, the compiler's one executability predicate asked by the
runtime before any worker starts (``RunSetup`` calls it twice: without, then with the models' shapes).
"""

from __future__ import annotations

from areal_flow.config import ConfigError
from areal_flow.tasks.catalog import build_task
from compiler.executable import check_executable
from compiler.plan import Plan
from runtime.topology import Topology


def preflight(plan: Plan, topo: Topology):
    """Check ``plan`` (module doc) and return the dataset node's task (``build_task``).

    Raises:
        ConfigError: naming the plan key or node, the config key and the fix.
    """
    _check_config_values(plan)
    _check_generators(plan)
    return _task(plan, topo)


def _check_generators(plan: Plan) -> None:
    """The sampling attributes of every generator (``stream`` node: ``n_samples``,
    ``max_new_tokens``, ``temperature``, ``top_p``, ``engine``) in their ranges, by the same
    check a traced graph passes (``areal_flow.ops.generate.check_sampling``): a hand-edited
    ``n_samples: -4`` is one line, not a run whose generator never finishes a group.

    Raises:
        ConfigError: naming the node, its graph line and the attribute.
    """
    from areal_flow.graph import GraphError
    from areal_flow.ops.generate import check_sampling

    for node in (n for n in plan.nodes if n.grain == "stream"):
        try:
            check_sampling(node)
        except (GraphError, KeyError, TypeError) as exc:
            raise ConfigError(f"plan node '{node.name}': {exc}") from None
        _check_engine_installed(plan, node)


def _check_engine_installed(plan: Plan, node) -> None:
    """A local run whose generator asks for vLLM (``gen.engine=vllm``) needs it importable here,
    where the local scheduler starts its workers (on Ray the workers' machines are checked by
    their own import).

    Raises:
        ConfigError: naming the node, the key and this interpreter.
    """
    import importlib.util
    import sys

    local = plan.run.get("scheduler", {}).get("type", "local") == "local"
    if local and node.attrs.get("engine") == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{node.where()}: engine='vllm' (gen.engine), but vllm is not installed in this "
                          f"interpreter ({sys.executable}); install it (its own venv: `make test-vllm` builds "
                          ".venv-vllm, docs/USAGE.md) or run the embedded engine (gen.engine=embedded; in a "
                          "plan.json given to `run --plan`, the node's \"engine\": \"embedded\")")


def _check_config_values(plan: Plan) -> None:
    """Check the plan's values that came from config keys (``plan.run``, lowered node attributes,
    a dataset node's keys: ``compiler.lowering.config_values``) with the config's own checks
    (``areal_flow.config_load.config_from_values``), the ones a YAML file or an override passes,
    so a hand-edited plan.json is refused as the same config would be, before the run folder
    is touched. (A plan compiled from a config passes: its values were checked on loading.)

    Raises:
        ConfigError: ``plan.run: <the config's message>`` or ``plan node '<name>': <...>``.
    """
    from areal_flow.config_load import config_from_values
    from compiler.lowering import config_values

    for where, values in config_values(plan.run, plan.nodes):
        try:
            config_from_values(values)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def _task(plan: Plan, topo: Topology):
    """The dataset node's task, made before the run folder is touched, with what the run needs
    of it beyond its values (:func:`_check_config_values`): its data file (``dataset.path``) and
    what the version-0 models need (``runtime.model_source.check_models``).

    Raises:
        ConfigError: naming the dataset node and the key, or the model.
    """
    from runtime.model_source import check_models

    node = topo.dataset
    try:
        task = build_task(node.attrs, plan.run["seed"])
    except (ValueError, OSError) as exc:  # a missing data file
        raise ConfigError(f"{node.where()}: {str(exc).splitlines()[0]}") from None
    check_models(plan, task)
    return task


def check_runnable(plan: Plan, topo: Topology, folders: dict[str, str] | None = None) -> None:
    """The compiler's one predicate (``compiler.executable``) on ``plan``, before any worker starts,
    with the run's rows per step; given the prepared models' ``folders``, with the shapes of their
    ``config.json`` (heads, layers, experts) for the models on several devices.

    Raises:
        compiler.executable.ExecutableError: naming the node and the broken rule.
    """
    shapes = {}
    if folders is not None:
        from transformers import AutoConfig

        from runtime.parallel.validate import model_shape

        multi = {n.model for n in plan.nodes if n.strategy is not None and n.parallel.world_size > 1}
        shapes = {m: model_shape(AutoConfig.from_pretrained(folders[m])) for m in sorted(multi)}
    check_executable(plan, shapes, rows=topo.batch_groups * topo.generate.attrs.get("n_samples", 1))
