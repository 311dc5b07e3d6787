"""Where a run's initial policy comes from: a folder in ``transformers`` format.

Owns the resolution of ``model.path`` into a folder both workers load at version 0:
a tiny preset gets its supervised warm start (cached, ``runtime.engines.sft``); a GGUF
preset or file is converted once and cached (``areal_flow.models.hf``); an HF folder is
used as it is. Loading a folder is :func:`load_pretrained`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_flow.config import ExperimentConfig
from areal_flow.models import tiny


def prepare_initial_model(cfg: ExperimentConfig, task, progress: bool = False) -> Path:
    """Folder holding the version-0 policy and its tokenizer.

    Raises:
        ValueError / OSError: from the loaders, naming ``model.path``.
    """
    spec = cfg.model.path
    if spec in tiny.PRESETS:
        from runtime.engines.sft import SFTConfig, warm_start

        ws = cfg.warm_start
        steps = ws.steps if ws.enabled else 0
        return warm_start(task, spec, SFTConfig(steps=steps, batch_size=ws.batch_size, lr=ws.lr, seed=cfg.seed,
                                            teacher_bug_rate=ws.teacher_bug_rate), progress=progress)
    from areal_flow.models.hf import resolve_folder

    return resolve_folder(spec)


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """``model.dtype`` (any spelling ``areal_flow.config.DTYPES`` accepts) -> ``torch.dtype``.

    Raises:
        ValueError: an unknown name, naming ``model.dtype`` and the accepted names.
    """
    if isinstance(name, torch.dtype):
        return name
    from areal_flow.config import DTYPES

    canonical = DTYPES.get(str(name).lower())
    if canonical is None:
        raise ValueError(f"model.dtype={name!r}: expected one of {', '.join(DTYPES)}")
    return getattr(torch, canonical)


def load_pretrained(folder: str | Path, dtype: str | torch.dtype = torch.float32):
    """``(model, tokenizer)`` from a ``transformers`` folder, on CPU, in eval mode.

    Args:
        folder: a ``save_pretrained`` folder (``prepare_initial_model``'s result).
        dtype: parameter dtype, a ``torch.dtype`` or a ``model.dtype`` name (``"bf16"``,
            ``"float32"``, ...); the weights are cast to it on load.

    Raises:
        ValueError: an unknown dtype name; OSError: from ``from_pretrained``.
    """
    dtype = torch_dtype(dtype)
    transformers.utils.logging.disable_progress_bar()  # per-load bars would break the run's progress bar
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(folder)
