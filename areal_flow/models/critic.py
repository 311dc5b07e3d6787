"""The value model (critic) of PPO: a causal-LM backbone with a scalar value head.

Built from the policy's folder (the usual PPO initialisation, Ouyang et al. 2022 §3.5:
the value function starts from a trained LM): the decoder stack is loaded with
``AutoModel`` (the LM head is dropped), and a ``Linear(hidden, 1)`` head reads the last
hidden state of every position.

Value layout (what ``BaseAlgorithm`` and ``advantages.gae`` expect): ``values[b, t]`` =
V(state before token t), i.e. the head applied to the hidden state at position
``t - 1`` (which has seen ``input_ids[:t]``); position 0 holds 0. This aligns values
with ``loss_mask`` and ``token_logprobs`` (docs/DEVELOPING.md).

A saved critic is a folder: the backbone in ``transformers`` format plus
``value_head.pt`` (the head's state dict).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModel

HEAD_FILE = "value_head.pt"


class ValueModel(torch.nn.Module):
    """``critic(input_ids=, attention_mask=) -> values [batch, seq]`` float32.

    Args:
        backbone: a ``transformers`` decoder without LM head (``AutoModel``) whose output
            has ``last_hidden_state [batch, seq, hidden]``.
        seed: seeds the head's initialisation (PyTorch's default ``Linear`` init), so two
            critics built from one folder are equal.
    """

    def __init__(self, backbone: torch.nn.Module, *, seed: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.value_head = torch.nn.Linear(backbone.config.hidden_size, 1)
        torch.random.set_rng_state(generator_state)

    @classmethod
    def from_policy(cls, folder: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> "ValueModel":
        """A critic whose backbone is the policy's decoder in ``folder``, with a new head.

        Raises:
            OSError / ValueError: from ``transformers`` when ``folder`` holds no model.
        """
        return cls(AutoModel.from_pretrained(folder, dtype=dtype), seed=seed)

    @classmethod
    def load(cls, folder: str | Path) -> "ValueModel":
        """A critic saved by :meth:`save`.

        Raises:
            FileNotFoundError: ``folder`` has no ``value_head.pt``.
        """
        folder = Path(folder)
        if not (folder / HEAD_FILE).is_file():
            raise FileNotFoundError(f"{folder}: no {HEAD_FILE}; not a critic saved by ValueModel.save")
        model = cls(AutoModel.from_pretrained(folder))
        model.value_head.load_state_dict(torch.load(folder / HEAD_FILE, weights_only=True))
        return model

    def save(self, folder: str | Path) -> None:
        """Write the backbone (``transformers`` format) and ``value_head.pt`` to ``folder``."""
        folder = Path(folder)
        self.backbone.save_pretrained(folder)
        torch.save(self.value_head.state_dict(), folder / HEAD_FILE)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Values ``[batch, seq]`` float32 for ``input_ids [batch, seq]`` (layout: module doc)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        v = self.value_head(hidden).squeeze(-1).float()
        return torch.nn.functional.pad(v[:, :-1], (1, 0))
