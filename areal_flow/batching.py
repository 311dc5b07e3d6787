"""Collate trajectory groups into the trainer's padded tensors.

Owns the one token layout the trainer, the algorithms and the tests share
(``docs/DEVELOPING.md``): prompt + response, right-padded; ``loss_mask`` is 1 at the
positions of response tokens, aligned with ``token_logprobs`` (position ``t`` holds the
log-prob of token ``t``).
"""

from __future__ import annotations

import torch

from areal_flow.types import Trajectory


def pad_tokens(trajectories: list[Trajectory], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids [B, T]`` int64 (prompt + response, right-padded with ``pad_id``) and
    ``attention_mask [B, T]`` int64; ``T`` = longest prompt + response, tokens."""
    length = max(len(t.prompt_ids) + len(t.output_ids) for t in trajectories)
    input_ids = torch.full((len(trajectories), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(trajectories), length), dtype=torch.long)
    for row, t in enumerate(trajectories):
        n = len(t.prompt_ids) + len(t.output_ids)
        input_ids[row, :n] = torch.tensor(t.prompt_ids + t.output_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
    return input_ids, attention_mask


def collate(trajectories: list[Trajectory], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad a list of trajectories into a training batch.

    Args:
        trajectories: ``B`` samples (any number of groups).
        pad_id: token id used for padding (masked everywhere).

    Returns:
        dict with ``input_ids [B, T]`` int64, ``attention_mask [B, T]`` int64,
        ``loss_mask [B, T]`` float32 (1 on response tokens), ``behavior_logprobs [B, T]``
        float32 (0 off the response), ``versions [B, T]`` int64 (-1 off the response),
        ``rewards [B]`` float32, ``group_ids [B]`` int64. ``T`` = longest prompt+response.
        Multi-turn trajectories (``turn_ids`` set) add ``turn_ids [B, T]`` int64 (0 off the
        response) and ``turn_rewards [B, n_turns]`` float32 (0 past a row's last turn);
        their ``loss_mask`` is 0 on observation tokens.

    Raises:
        ValueError: an empty list, a trajectory without a reward, or behavior log-probs
            whose length differs from its response (naming the sample id).
    """
    if not trajectories:
        raise ValueError("collate: no trajectories")
    input_ids, attention_mask = pad_tokens(trajectories, pad_id)
    n, length = input_ids.shape
    loss_mask = torch.zeros((n, length), dtype=torch.float32)
    behavior = torch.zeros((n, length), dtype=torch.float32)
    versions = torch.full((n, length), -1, dtype=torch.long)
    for row, t in enumerate(trajectories):
        if t.reward is None:
            raise ValueError(f"collate: sample {t.sample_id} has no reward")
        if len(t.behavior_logprobs) != len(t.output_ids) or len(t.versions) != len(t.output_ids):
            raise ValueError(f"collate: sample {t.sample_id}: behavior_logprobs/versions do not match its response")
        p, r = len(t.prompt_ids), len(t.output_ids)
        loss_mask[row, p : p + r] = 1.0 if t.loss_mask is None else torch.tensor(t.loss_mask, dtype=torch.float32)
        behavior[row, p : p + r] = torch.tensor(t.behavior_logprobs, dtype=torch.float32)
        versions[row, p : p + r] = torch.tensor(t.versions, dtype=torch.long)
    out = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "behavior_logprobs": behavior,
        "versions": versions,
        "rewards": torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        "group_ids": torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
    }
    if any(t.turn_ids is not None for t in trajectories):
        out.update(_turns(trajectories, length))
    return out


def _turns(trajectories: list[Trajectory], length: int) -> dict[str, torch.Tensor]:
    n_turns = max(len(t.turn_rewards or ()) for t in trajectories)
    turn_ids = torch.zeros((len(trajectories), length), dtype=torch.long)
    turn_rewards = torch.zeros((len(trajectories), max(n_turns, 1)), dtype=torch.float32)
    for row, t in enumerate(trajectories):
        if t.turn_ids is None or len(t.turn_ids) != len(t.output_ids):
            raise ValueError(f"collate: sample {t.sample_id}: turn_ids do not match its response (single- and "
                             "multi-turn trajectories cannot share a batch)")
        p = len(t.prompt_ids)
        turn_ids[row, p : p + len(t.turn_ids)] = torch.tensor(t.turn_ids, dtype=torch.long)
        turn_rewards[row, : len(t.turn_rewards)] = torch.tensor(t.turn_rewards, dtype=torch.float32)
    return {"turn_ids": turn_ids, "turn_rewards": turn_rewards}
