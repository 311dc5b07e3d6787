"""The reward model (RM): a causal-LM backbone with a scalar head on the last token.

Built from a policy's folder (the usual RM initialisation, Ouyang et al. 2022 §3.5: the
RM starts from a trained LM with its unembedding layer replaced by a scalar head): the
decoder stack is loaded with ``AutoModel`` (the LM head is dropped), and a
``Linear(hidden, 1)`` head reads the hidden state at the **last non-padded token** of each
sequence, i.e. the EOS that ends the response when the input is a trajectory's
``prompt_ids + output_ids`` (the layout of ``areal_flow.batching.collate``).

Inputs are right-padded (``attention_mask`` is 1 on a prefix of every row, 0 after), so
position ids are the plain ``0 .. T-1`` and a padded row scores as the row alone.

A saved RM is a folder: the backbone in ``transformers`` format plus ``reward_head.pt``
(the head's state dict), the layout of ``areal_flow.models.critic``. This module does not
train (``runtime.engines.reward_model`` does) and never touches the cache.
"""

from __future__ import annotations

from pathlib import Path

import torch

from areal_flow.models.scalar_head import ScalarHeadModel

HEAD_FILE = "reward_head.pt"


class RewardModel(ScalarHeadModel):
    """``rm(input_ids, attention_mask) -> scores [batch]`` float32 logits.

    A score is the logit of P(response is correct | prompt); :meth:`score_probability`
    applies the sigmoid.

    Args:
        backbone: a ``transformers`` decoder without LM head (``AutoModel``) whose output
            has ``last_hidden_state [batch, seq, hidden]``.
        seed: seeds the head's initialisation (PyTorch's default ``Linear`` init), so two
            RMs built from one folder are equal.
    """

    HEAD_FILE = HEAD_FILE
    KIND = "reward model"

    @property
    def reward_head(self) -> torch.nn.Linear:
        return self.head

    @classmethod
    def load(cls, folder: str | Path) -> "RewardModel":
        """An RM saved by :meth:`save`, fp32, in eval mode. Raises FileNotFoundError without ``reward_head.pt``."""
        return super().load(folder).eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Scores (logits) ``[batch]`` float32.

        Args:
            input_ids: ``[batch, seq]`` int64, right-padded.
            attention_mask: ``[batch, seq]``, 1 on each row's tokens, 0 on its padding.

        Raises:
            ValueError: shapes differ, or a row of ``attention_mask`` is empty or not right
                padding (a 0 before a 1).
        """
        if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
            raise ValueError(f"RewardModel: input_ids {tuple(input_ids.shape)} and attention_mask "
                             f"{tuple(attention_mask.shape)} must be the same [batch, seq] shape")
        mask = attention_mask.long()
        lengths = mask.sum(1)
        if bool((lengths == 0).any()) or bool((mask.cummin(1).values != mask).any()):
            raise ValueError("RewardModel: every attention_mask row must be right padding (1s then 0s) "
                             "with at least one token")
        hidden = self.backbone(input_ids=input_ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
        return self.head(last).squeeze(-1).float()

    def score_probability(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """P(correct) ``[batch]`` float32 in (0, 1): ``sigmoid(forward(...))``; same arguments and errors."""
        return torch.sigmoid(self.forward(input_ids, attention_mask))
