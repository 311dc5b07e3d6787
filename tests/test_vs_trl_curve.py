"""bench/vs_trl_curve.py: the time-to-accuracy points of ``bench/vs_trl.py --curve`` on the
areal-flow side (each checkpoint scored, timed by its train_step span on the loop's clock), and
the line that says when an areal-flow run reached a TRL run's final accuracy."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is scripts, as tests/test_vs_trl_jobs.py

from bench import vs_trl_curve  # noqa: E402
from bench.vs_trl_curve import areal_points, first_reaching, reach_line, score_snapshots, snapshots  # noqa: E402

from areal_flow.models.tiny import build_model  # noqa: E402
from areal_flow.models.tokenizer import build_char_tokenizer  # noqa: E402


def _span(name: str, ts: int, dur: int, cat: str = "node", proc: str = "trainer", **args) -> dict:
    return {"name": name, "cat": cat, "ts": ts, "dur": dur, "proc": proc, "args": args}


def test_areal_points_time_each_checkpoint_by_its_train_step_and_score_its_weights(tmp_path):
    tok = build_char_tokenizer()
    marks = {}
    for version, seed in ((2, 5), (4, 6)):  # two checkpoints holding different weights
        folder = tmp_path / "checkpoints" / f"version_{version}"
        model = build_model("tiny-s", len(tok), seed=seed)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        marks[version] = float(model.lm_head.weight.detach().sum())
    (tmp_path / "checkpoints" / "version_6.tmp").mkdir()  # a torn write is not a version
    # the loop starts at 1.0 s (the generator's first engine step) after 0.25 s of start-up wait;
    # train_step spans end at 2.0, 3.0, 4.5, 6.0 s; checkpoint writes after steps 2 and 4; other spans are not counted
    spans = [_span("train_step", 1_500_000, 500_000, step=0), _span("train_step", 2_500_000, 500_000, step=1),
             _span("train_step", 4_000_000, 500_000, step=2), _span("train_step", 5_000_000, 1_000_000, step=3),
             _span("generate", 5_900_000, 900_000), _span("train_step", 7_000_000, 10, cat="phase"),
             _span("checkpoint", 3_000_000, 400_000, cat="io"), _span("checkpoint", 6_000_000, 300_000, cat="io"),
             _span("checkpoint", 3_500_000, 700_000, cat="io", proc="critic")]  # another step group's part
    points = areal_points(tmp_path, 1_000_000, 0.25, spans, lambda m: float(m.lm_head.weight.detach().sum()))
    # version 2 ends with the 2nd train_step at 3.0 s: 3.0 - 1.0 - 0.25 = 1.75 s; version 4 at 6.0 s, after
    # version 2's checkpoint write (0.4 s; version 4's own comes after it): 6.0 - 1.0 - 0.4 - 0.25 = 4.35 s
    assert [(v, t) for v, t, _ in points] == [(2, pytest.approx(1.75)), (4, pytest.approx(4.35))]
    assert [a for _, _, a in points] == [pytest.approx(marks[2], rel=1e-6), pytest.approx(marks[4], rel=1e-6)]
    # a resumed run traces step 3 again later: its last span counts (ends at 9.0 s, after both of this
    # process's writes: 9.0 - 1.0 - (0.4 + 0.3) - 0.25 = 7.05 s)
    again = spans + [_span("train_step", 8_500_000, 500_000, step=3)]
    assert areal_points(tmp_path, 1_000_000, 0.25, again, lambda m: 0.0)[1][:2] == (4, pytest.approx(7.05))
    with pytest.raises(ValueError, match="no 'train_step' span of step 3"):
        areal_points(tmp_path, 1_000_000, 0.25, spans[:3], lambda m: 0.0)
    with pytest.raises(ValueError, match="no checkpoints"):
        areal_points(tmp_path / "nothing", 0, 0.0, spans, lambda m: 0.0)


def test_snapshots_are_scored_in_order_and_the_model_ends_on_the_last():
    model = torch.nn.Linear(2, 1, bias=False)
    points = [(1, 0.5, {"weight": torch.tensor([[1.0, 2.0]])}), (2, 1.5, {"weight": torch.tensor([[3.0, 4.0]])})]
    scored = score_snapshots(model, points, lambda m: float(m.weight.detach().sum()))
    assert scored == [(1, 0.5, 3.0), (2, 1.5, 7.0)]
    assert model.weight.tolist() == [[3.0, 4.0]]


def test_reach_line_compares_the_first_point_at_trls_final_accuracy_with_trls_time():
    trl = [(100, 20.0, 0.70), (400, 80.0, 0.90)]
    areal = [(100, 10.0, 0.80), (300, 32.0, 0.905), (400, 40.0, 0.88)]
    assert first_reaching(areal, 0.90) == (300, 32.0, 0.905)
    line = reach_line("areal k=2", areal, "TRL fp32", trl)
    assert "at step 300, 32.0 s" in line and "80.0 s (step 400): 2.50x" in line  # 80 / 32
    short = [(100, 10.0, 0.80), (200, 20.0, 0.85)]
    line = reach_line("areal k=2", short, "TRL fp32", trl)
    assert "did not reach TRL fp32's final 90.0%" in line and "best 85.0% at step 200, 20.0 s" in line


def test_trl_snapshots_every_n_steps_and_at_the_last_leave_their_copying_out(monkeypatch):
    """The TRL callback on a fake clock: train() begins at 0 s; copies at steps 2 and 4 take 1 s and
    2 s, the last step's (5) 0.5 s. Each point's time is the clock less the copying before it."""
    from types import SimpleNamespace

    clock = iter([0.0, 10.0, 11.0, 20.0, 22.0, 25.0, 25.5])
    monkeypatch.setattr(vs_trl_curve.time, "perf_counter", lambda: next(clock))
    model = torch.nn.Linear(2, 1, bias=False)
    kept = snapshots(2, model)
    kept.on_train_begin(None, SimpleNamespace(global_step=0, max_steps=5), None)
    for step in range(1, 6):
        with torch.no_grad():
            model.weight.fill_(float(step))
        kept.on_step_end(None, SimpleNamespace(global_step=step, max_steps=5), None)
    assert [(s, t) for s, t, _ in kept.points] == [(2, 10.0), (4, 19.0), (5, 22.0)]  # 20 - 1, 25 - 3
    assert kept.paused_s == 3.5
    assert [float(state["weight"][0, 0]) for _, _, state in kept.points] == [2.0, 4.0, 5.0]  # copies, not views
