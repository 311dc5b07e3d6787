"""Where a run's initial policy comes from: a folder in ``transformers`` format.

Owns the resolution of ``model.path`` into a folder both workers load at version 0:
a tiny preset gets its supervised warm start (cached, ``runtime.engines.sft``); a GGUF
preset or file is converted once and cached (``areal_flow.models.hf``); an HF folder is
used as it is. Loading a folder is :func:`load_pretrained`.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from areal_flow.config import ExperimentConfig
from areal_flow.dtypes import torch_dtype
from areal_flow.models.in_memory import copy_out_of_file
from areal_flow.models.tokenizer import load_tokenizer


def prepare_initial_model(cfg: ExperimentConfig, task, progress: bool = False) -> Path:
    """Folder holding the version-0 policy of ``cfg.model.path`` and its tokenizer (the
    config-driven form of :func:`prepare_models`, for ``areal-flow eval``).

    Raises:
        ValueError / OSError: from the loaders, naming ``model.path``.
    """
    import dataclasses

    return _initial_folder(cfg.model.path, dataclasses.asdict(cfg.warm_start), cfg.seed, task, progress)


_LOADING = threading.Lock()  # load_pretrained: one model at a time in a process
RM_SUFFIX = "-rm"  # ``Model("rm", "tiny-arith-rm")``: a reward model trained in code from the preset's warm start


def prepare_models(plan, task, progress: bool = False, names=None) -> dict[str, str]:
    """Model name -> folder of its version-0 weights, for every model of ``plan`` (or those in
    ``names``).

    A tiny preset gets its supervised warm start (``plan.run["warm_start"]``, cached); a
    GGUF preset or file is converted once (cached); an HF folder is used as it is. A critic
    (head ``value``) starts from its spec's LM folder (the value head is added on load); a
    reward model whose spec is ``<preset>-rm`` is trained in code on the task from the
    preset's warm start (``runtime.engines.reward_model``, cached).

    Raises:
        ValueError / OSError: from the loaders, naming the spec.
    """
    ws = plan.run.get("warm_start", {})
    seed = int(plan.run["seed"])
    folders: dict[str, str] = {}
    for name, info in plan.models.items():
        if names is not None and name not in names:
            continue
        spec = info["spec"]
        base = spec.removesuffix(RM_SUFFIX) if info["head"] == "reward" else spec
        folder = _initial_folder(base, ws, seed, task, progress)
        if info["head"] == "reward" and spec.endswith(RM_SUFFIX):
            from runtime.engines.reward_model import RewardModelConfig, train_reward_model

            rm = plan.run.get("reward_model", {})
            folder = train_reward_model(task, folder, RewardModelConfig(seed=seed, **rm), progress=progress)
        folders[name] = str(folder)
    return folders


PROBE_ROWS = 200
"""Teacher demonstrations :func:`check_models` draws to see that the task makes them."""


def check_models(plan, task) -> None:
    """Refuse, before the run folder is touched, a version-0 model :func:`prepare_models` cannot
    make from ``task``: a tiny preset's warm start with ``warm_start.teacher_bug_rate`` > 0 learns
    from the task's teacher demonstrations (``runtime.engines.sft.training_problems``; also for
    ``warm_start.enabled: false``, whose cache key holds them), which not every task has, and
    which a task may refuse for its data (:data:`PROBE_ROWS` of them are drawn here; e.g. a
    reasoning-gym dataset with no two-term ``+``/``-`` entry).

    Raises:
        ConfigError: naming the model, ``warm_start.teacher_bug_rate``, ``dataset.name`` and the fix.
    """
    from areal_flow.config import ConfigError
    from areal_flow.models.names import resolve_name

    rate = plan.run.get("warm_start", {}).get("teacher_bug_rate", 0.0)
    if not rate:
        return
    for name, info in plan.models.items():
        spec = info["spec"].removesuffix(RM_SUFFIX) if info["head"] == "reward" else info["spec"]
        if resolve_name(spec).kind != "tiny":
            continue
        if not hasattr(task, "demonstrations"):
            raise ConfigError(f"model '{name}' ({spec}) is warm-started with warm_start.teacher_bug_rate={rate}, which "
                              f"needs teacher demonstrations, and the {task.name} task (dataset.name) has none; set "
                              "warm_start.teacher_bug_rate=0 or pick a task that has them")
        try:
            task.demonstrations(PROBE_ROWS, int(plan.run["seed"]), rate)
        except ValueError as exc:
            raise ConfigError(f"model '{name}' ({spec}) is warm-started with teacher demonstrations: {exc}") from None


def _initial_folder(spec: str, ws: dict, seed: int, task, progress: bool) -> Path:
    """The version-0 folder of ``spec``, resolved by ``areal_flow.models.names.resolve_name``
    (as the compiler resolves it): a tiny preset (any case) is warm-started, anything else
    is ``areal_flow.models.hf.folder_of`` its resolution."""
    from areal_flow.models.names import resolve_name

    ref = resolve_name(spec)
    if ref.kind == "tiny":
        from runtime.engines.sft import SFTConfig, warm_start

        steps = ws.get("steps", 0) if ws.get("enabled", True) else 0
        return warm_start(task, ref.preset, SFTConfig(steps=steps, batch_size=ws.get("batch_size", 64),
                                                      lr=ws.get("lr", 3e-3), seed=seed,
                                                      teacher_bug_rate=ws.get("teacher_bug_rate", 0.0)),
                          progress=progress)
    from areal_flow.models.hf import folder_of

    return folder_of(ref)


def load_pretrained(folder: str | Path, dtype: str | torch.dtype = torch.float32, *, in_memory: bool = False):
    """``(model, tokenizer)`` from a ``transformers`` folder, on CPU, in eval mode.

    Args:
        folder: a ``save_pretrained`` folder (``prepare_initial_model``'s result).
        dtype: parameter dtype, a ``torch.dtype`` or a ``model.dtype`` name (``"bf16"``,
            ``"float32"``, ...); the weights are cast to it on load.
        in_memory: the parameters copied out of the checkpoint file's mapping into the process's
            own memory now (``areal_flow.models.in_memory``: a CPU worker that will write them).

    Raises:
        ValueError: an unknown dtype name; OSError: from ``from_pretrained``.
    """
    dtype = torch_dtype(dtype)
    transformers.utils.logging.disable_progress_bar()  # per-load bars would break the run's progress bar
    with _LOADING:  # one load at a time: from_pretrained's meta-device initialisation is process-wide (runtime.hybrid)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    return copy_out_of_file(model) if in_memory else model, load_tokenizer(folder)
