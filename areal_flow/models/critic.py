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

from areal_flow.models.scalar_head import ScalarHeadModel

HEAD_FILE = "value_head.pt"


class ValueModel(ScalarHeadModel):
    """``critic(input_ids=, attention_mask=) -> values [batch, seq]`` float32.

    Args: those of :class:`~areal_flow.models.scalar_head.ScalarHeadModel` (the head is
    ``value_head``, saved as ``value_head.pt``).
    """

    HEAD_FILE = HEAD_FILE
    KIND = "critic"

    @classmethod
    def from_policy(cls, folder: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                    in_memory: bool = False) -> "ValueModel":
        """A critic whose backbone is the policy's decoder in ``folder``, with a new head
        (``in_memory``: :meth:`from_backbone`'s)."""
        return cls.from_backbone(folder, seed=seed, dtype=dtype, in_memory=in_memory)

    @property
    def value_head(self) -> torch.nn.Linear:
        return self.head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Values ``[batch, seq]`` float32 for ``input_ids [batch, seq]`` (layout: module doc)."""
        v = self.values_after(input_ids, attention_mask)
        return torch.nn.functional.pad(v[:, :-1], (1, 0))

    def values_after(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The head on the hidden state at every position, unshifted: ``[batch, seq]`` float32,
        entry ``p`` = V(state after token ``p``), what :meth:`forward` shifts one position right.
        ``position_ids [1 or batch, seq]``: the positions of a sequence chunk (context parallelism,
        ``runtime.parallel_critic``); default ``0 .. seq-1``."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids).last_hidden_state
        return self.head(hidden).squeeze(-1).float()
