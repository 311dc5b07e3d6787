"""The trainer's per-step bookkeeping made cheaper without changing its values: the no-grad
entropy metric in chunks of rows (``areal_flow.algorithms.model_runner``) and the
``trajectories.jsonl`` line written without a deep copy (``runtime.stage_worker``)."""

import json
import math
from dataclasses import dataclass

import torch

from areal_flow.algorithms import model_runner
from areal_flow.algorithms.model_runner import entropy_rows_per_chunk, token_entropy_from_logits
from areal_flow.types import Trajectory
from runtime.stage_worker import trajectory_line


def _logits() -> torch.Tensor:
    """3 rows, 3 positions, vocabulary 4: row 0 uniform (entropy ln 4 at every position), row 1
    one token at +100 (entropy ~0), row 2 two tokens equal and two at -100 (entropy ln 2)."""
    logits = torch.zeros(3, 3, 4)
    logits[1, :, 0] = 100.0
    logits[2, :, 2:] = -100.0
    return logits


def test_entropy_metric_in_chunks_matches_the_formula():
    expected = torch.tensor([[0.0, math.log(4), math.log(4)], [0.0, 0.0, 0.0], [0.0, math.log(2), math.log(2)]])
    out = token_entropy_from_logits(_logits(), 1.0, with_grad=False)
    assert torch.allclose(out, expected, atol=1e-6)


def test_entropy_metric_is_the_same_one_row_at_a_time(monkeypatch):
    logits = torch.randn(5, 7, 11, generator=torch.Generator().manual_seed(0))
    whole = token_entropy_from_logits(logits, 0.7, with_grad=False)
    monkeypatch.setattr(model_runner, "ENTROPY_CHUNK_ELEMENTS", 1)  # one row per chunk
    assert entropy_rows_per_chunk(6, 11) == 1
    assert torch.allclose(token_entropy_from_logits(logits, 0.7, with_grad=False), whole, atol=1e-6)
    monkeypatch.setattr(model_runner, "ENTROPY_CHUNK_ELEMENTS", 2 * 6 * 11)  # rows 0-1, 2-3, 4
    assert entropy_rows_per_chunk(6, 11) == 2
    assert torch.allclose(token_entropy_from_logits(logits, 0.7, with_grad=False), whole, atol=1e-6)


def test_entropy_chunk_rows_fit_the_budget():
    budget = model_runner.ENTROPY_CHUNK_ELEMENTS
    assert entropy_rows_per_chunk(11, 50) == budget // 550  # tiny-arith: a whole step batch at once
    assert entropy_rows_per_chunk(512, 49152) == 1  # SmolLM2: more than the budget per row, one row


@dataclass
class _Note:
    text: str


def test_trajectory_line_writes_every_field_step_and_staleness():
    t = Trajectory(sample_id="3:1", group_id=3, prompt_ids=[1, 7], output_ids=[9, 2], behavior_logprobs=[-0.5, -1.0],
                   versions=[4, 5], finish_reason="stop", output_text="5", reward=1.0,
                   meta={"answer": "5", "note": _Note("hi")})
    row = json.loads(trajectory_line(t, 6))
    assert row["step"] == 6 and row["staleness"] == 2  # trainer version 6 - oldest token's version 4
    assert row["output_ids"] == [9, 2] and row["versions"] == [4, 5] and row["reward"] == 1.0
    assert row["meta"] == {"answer": "5", "note": {"text": "hi"}}
    assert set(row) == set(vars(t)) | {"step", "staleness"}
