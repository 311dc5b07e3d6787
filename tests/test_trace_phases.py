"""The forward / backward / optimizer spans of a train step (``runtime.train_phases``).

The expected order is written by hand from what one optimizer step over two micro-batches
does: a no-grad forward (the proximal log-probs), then forward and backward of micro-batch 0,
the same of micro-batch 1, then the optimizer step.
"""

from __future__ import annotations

import torch

from runtime.timeline import PhaseUse, Timeline, format_timeline
from runtime.trace import TraceRecorder, read_spans
from runtime.train_phases import TrainPhaseSpans


class _Lm(torch.nn.Module):
    """``logits = Linear(x)`` returned the Hugging Face way (an object with ``.logits``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x):
        return type("Out", (), {"logits": self.proj(x)})()


def _one_step(model, optimizer, rows: torch.Tensor) -> None:
    with torch.no_grad():
        model(rows)  # the proximal policy's log-probs, before the update
    optimizer.zero_grad()
    for part in rows.split(2):
        model(part).logits.square().mean().backward()
    optimizer.step()


def _phases(tmp_path) -> list[tuple]:
    spans = read_spans(tmp_path)
    assert all(s["name"] == "train_step" and s["cat"] == "phase" and s["track"] == "step" for s in spans)
    return [(s["args"]["phase"], s["args"].get("micro_batch"), s["args"].get("grad"), s["args"]["step"])
            for s in sorted(spans, key=lambda s: (s["ts"], -s["dur"]))]


def test_phases_of_a_step_with_two_micro_batches_in_order(tmp_path):
    torch.manual_seed(0)
    model = _Lm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    phases = TrainPhaseSpans(model, optimizer, "train_step")
    trace = TraceRecorder(tmp_path, "train_step/0")
    rows = torch.randn(4, 4)
    _one_step(model, optimizer, rows)  # outside active(): records nothing
    with phases.active(trace, step=7):
        _one_step(model, optimizer, rows)
    _one_step(model, optimizer, rows)
    trace.close()
    assert _phases(tmp_path) == [
        ("forward", None, False, 7),
        ("forward", 0, True, 7), ("backward", 0, None, 7),
        ("forward", 1, True, 7), ("backward", 1, None, 7),
        ("optimizer", None, None, 7),
    ]
    spans = sorted(read_spans(tmp_path), key=lambda s: s["ts"])
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(spans, spans[1:]))  # sequential, no overlap


def test_a_disabled_recorder_or_none_records_nothing(tmp_path):
    model = _Lm()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    phases = TrainPhaseSpans(model, optimizer, "train_step")
    with phases.active(None, step=0):
        _one_step(model, optimizer, torch.randn(2, 4))
    with phases.active(TraceRecorder(None, "off"), step=1):
        _one_step(model, optimizer, torch.randn(2, 4))
    assert not (tmp_path / "trace").exists() and read_spans(tmp_path) == []


def test_timeline_reports_phase_shares_of_the_nodes_busy_time(tmp_path):
    from runtime.timeline import NodeUse

    t = Timeline(wall_s=10.0, nodes={"train_step": NodeUse(busy_us=4_000_000, instances=1, fraction=0.4)}, waits={},
                 phases={("train_step", "forward"): PhaseUse(4, 1.0, 250.0),
                         ("train_step", "backward"): PhaseUse(4, 2.0, 500.0)})
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in format_timeline(t).splitlines()
            if line.startswith("train_step ") and len(line.split()) == 6}
    # count, total s, mean ms, share of busy: 1 s of 4 s = 25 %, 2 s of 4 s = 50 % (by hand)
    assert rows == {("train_step", "forward"): ["4", "1.00", "250.00", "25.0%"],
                    ("train_step", "backward"): ["4", "2.00", "500.00", "50.0%"]}
