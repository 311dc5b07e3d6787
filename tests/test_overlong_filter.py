"""``train.loss.mask_truncated``: DAPO's overlong filtering (Yu et al. 2025, §3.4), TRL's
``mask_truncated_completions``: a response cut at ``max_new_tokens`` (``finish_reason ==
"length"``) gives no loss, so the step's token-mean runs over the other responses only.

By hand on ``rl_step_cases.rl_batch`` (responses of 1, 2, 3, 4 | 3, 6, 5, 4 tokens, 28 in
all), rows 1 and 5 cut: the step covers 28 - 2 - 6 = 20 tokens of 6 sequences, 2 / 8 = 0.25
of its samples filtered; and the update is the one of the same batch with those two rows
left out (their advantages were computed with the group, before the filter, and are kept).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from areal_flow.algorithms.dapo import overlong_filter
from areal_flow.config import ConfigError
from areal_flow.config_load import load_config
from areal_flow.values import Advantages
from rl_step_cases import policy_folder, rl_batch, settings
from runtime.executors.train import TrainStepExecutor
from runtime.model_source import load_pretrained

CUT = (1, 5)


def test_the_mask_by_hand():
    mask = torch.tensor([[0.0, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]])
    got = overlong_filter(mask, torch.tensor([False, True, False]))
    assert got.tolist() == [[0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 1, 1]]
    assert mask[1].sum() == 3  # the input is left as it was
    with pytest.raises(ValueError, match=r"truncated \(2,\) must be \[batch\] for loss_mask \(3, 4\)"):
        overlong_filter(mask, torch.tensor([True, False]))


def test_the_config_key_and_a_misspelling():
    assert load_config(None, ["train.loss.mask_truncated=true"]).train.loss == {"mask_truncated": True}
    with pytest.raises(ConfigError, match="unknown config key 'train.loss.mask_truncate'; did you mean "
                                         "'train.loss.mask_truncated'"):
        load_config(None, ["train.loss.mask_truncate=true"])


def _step(folder, batch: dict, trajectories: list, mask_truncated: bool) -> tuple[dict, dict]:
    """One optimizer step of a one-process train_step executor: its stats and weights after."""
    torch.manual_seed(0)
    spec = settings(folder, "grpo")
    spec.loss["mask_truncated"] = mask_truncated
    model, _ = load_pretrained(folder)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    executor = object.__new__(TrainStepExecutor)
    executor.__dict__.update(
        node=SimpleNamespace(name="train_step"), ctx=SimpleNamespace(dtype=torch.float32), port="advantages",
        settings=spec, model=model, optimizer=optimizer, algorithm=spec.build_algorithm(model, optimizer),
        critic=False, ranks=None, rank_critic=None, micro_batches=1, device="cpu", phases=None,
        monitor=SimpleNamespace(check=lambda step, stats, adv: {}))
    out = executor.run({"advantages": Advantages(batch, trajectories)}, {"step": 0, "publish": False})
    return out["stats"].metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_cut_responses_give_no_loss(tmp_path):
    torch.set_num_threads(1)
    folder = policy_folder(tmp_path)
    batch = rl_batch(folder)
    rows = batch["input_ids"].shape[0]
    trajectories = [SimpleNamespace(finish_reason="length" if i in CUT else "stop") for i in range(rows)]
    before = batch["loss_mask"].clone()

    stats, weights = _step(folder, batch, trajectories, mask_truncated=True)
    assert stats["n_tokens"] == 20 and stats["n_seqs"] == 6
    assert stats["overlong_filtered"] == 0.25
    assert torch.equal(batch["loss_mask"], before)  # the step's batch is not changed for other consumers

    kept = [i for i in range(rows) if i not in CUT]
    without = {k: v[kept] for k, v in batch.items()}
    ref_stats, ref_weights = _step(folder, without, [trajectories[i] for i in kept], mask_truncated=False)
    assert ref_stats["n_tokens"] == 20 and "overlong_filtered" not in ref_stats
    assert stats["loss"] == pytest.approx(ref_stats["loss"], rel=1e-5)
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")

    off_stats, off_weights = _step(folder, batch, trajectories, mask_truncated=False)  # the default: every row
    assert off_stats["n_tokens"] == 28
    assert any(not torch.allclose(off_weights[n], weights[n]) for n in weights)
