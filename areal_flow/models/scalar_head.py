"""A causal-LM backbone with a ``Linear(hidden, 1)`` head: what the critic and the reward
model share (building from a policy folder, a seeded head, the saved-folder layout).

Owns construction and persistence only; the subclasses (``areal_flow.models.critic``,
``areal_flow.models.reward_model``) say which positions the head reads. A saved model is a
folder: the backbone in ``transformers`` format plus ``HEAD_FILE`` (the head's state dict).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
from transformers import AutoModel

from areal_flow.models.in_memory import copy_out_of_file
from areal_flow.models.quiet import no_progress_bars


class ScalarHeadModel(torch.nn.Module):
    """Backbone (``AutoModel``: ``last_hidden_state [batch, seq, hidden]``) + scalar head.

    Args:
        backbone: a ``transformers`` decoder without LM head.
        seed: seeds the head's initialisation (PyTorch's default ``Linear`` init), so two
            models built from one folder are equal; the global RNG is left as it was.
    """

    HEAD_FILE: ClassVar[str] = "head.pt"
    KIND: ClassVar[str] = "scalar-head model"

    def __init__(self, backbone: torch.nn.Module, *, seed: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.head = torch.nn.Linear(backbone.config.hidden_size, 1)

    @classmethod
    def from_backbone(cls, folder: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                      in_memory: bool = False):
        """A model whose backbone is the decoder of the causal LM in ``folder``, with a new head;
        ``in_memory``: the backbone copied out of the file's mapping now (``areal_flow.models.in_memory``:
        a model that will be trained on CPU).

        Raises:
            OSError / ValueError: from ``transformers`` when ``folder`` holds no model.
        """
        with no_progress_bars():  # loaded inside a run (a critic's worker): no bar within the run's
            backbone = AutoModel.from_pretrained(folder, dtype=dtype)
        return cls(copy_out_of_file(backbone) if in_memory else backbone, seed=seed)

    @classmethod
    def load(cls, folder: str | Path):
        """A model saved by :meth:`save`, fp32.

        Raises:
            FileNotFoundError: ``folder`` has no ``HEAD_FILE``.
        """
        folder = Path(folder)
        if not (folder / cls.HEAD_FILE).is_file():
            raise FileNotFoundError(f"{folder}: no {cls.HEAD_FILE}; not a {cls.KIND} saved by {cls.__name__}.save")
        with no_progress_bars():
            model = cls(AutoModel.from_pretrained(folder, dtype=torch.float32))
        model.head.load_state_dict(torch.load(folder / cls.HEAD_FILE, weights_only=True))
        return model

    def save(self, folder: str | Path) -> None:
        """Write the backbone (``transformers`` format) and ``HEAD_FILE`` to ``folder``."""
        folder = Path(folder)
        with no_progress_bars():  # a checkpoint inside a run: no bar within the run's
            self.backbone.save_pretrained(folder)
        torch.save(self.head.state_dict(), folder / self.HEAD_FILE)
