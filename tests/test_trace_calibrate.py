"""Predicted vs measured idle time (``runtime.calibrate``) on a hand-made run folder.

The run: 3 train steps of B = 2 groups x 4 responses (prompts of 6 tokens, responses of 2
or 4 tokens), one replica. Its trace, in microseconds:

    generate   [0,1000] [1000,2000] [2000,3000] [3000,4000] [4300,5300] [5300,6300]  finish groups 0..5
               [6600,7600] finishes group 6, never trained
    train_step [2000,4000] [4300,6300] [6600,8600]
    publish    v1 [4000,4100]  v2 [6300,6400]
    receive    v1 [4100,4150]  v2 [6400,6450]
    load       v1 [4150,4300]  v2 [6450,6600]

Every expected figure below is worked out by hand from this table and the module doc.

The resumed variant (issue 17): the same table is the attempt resumed from version 20
(steps 20..22, groups 40..46, versions 21 and 22 loaded, times shifted by 10 s), after an
earlier attempt that also loaded version 21 before it died; the figures are the same.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from areal_flow.config_load import load_config
from compiler.program import compile_program
from runtime.calibrate import CalibrationError, calibrate, calibrated_plan, compare, format_comparison
from runtime.trace import TraceRecorder, mark_attempt, merge_trace
from test_trace_replay import REPO, TINY, penalized_grpo


def _run_folder(tmp_path: Path, loads: bool = True, resumed_from: int = 0, marked: bool = True) -> Path:
    """The module doc's run; with ``resumed_from`` = v0 > 0 the resumed variant (``marked``:
    the earlier attempt and the attempt marker are in the trace; else only the resumed
    attempt's spans, as a trace emptied by the resume)."""
    cfg = load_config(REPO / "graphs/arith_grpo.yaml", TINY)
    (tmp_path / "plan.json").write_text(compile_program(penalized_grpo(cfg), cfg).to_json())
    v0, t0 = resumed_from, 10_000_000 if resumed_from else 0
    earlier = [{"step": s, "prompt_ids": [1] * 50, "output_ids": [2] * 50, "versions": []} for s in range(v0)]
    rows = earlier + [{"step": v0 + i // 8, "prompt_ids": [1] * 6, "output_ids": [2] * (2 if i % 2 else 4),
                       "versions": []} for i in range(24)]
    (tmp_path / "trajectories").mkdir()
    (tmp_path / "trajectories" / "trajectories.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    gen, train = TraceRecorder(tmp_path, "generate/0"), TraceRecorder(tmp_path, "train_step/0")
    if v0 and marked:  # the attempt that died after loading version v0 + 1: busy all the time
        gen.complete("generate", "engine", 0, 900_000, finished=[2 * v0 + 1])
        train.complete("train_step", "step", 0, 900_000, step=v0)
        gen.complete("sync_weights", "weights", 900_000, 950_000, phase="load", version=v0 + 1)
        gen.close(), train.close()
        mark_attempt(tmp_path, v0, now=t0 - 1000)
    for index, start in enumerate([0, 1000, 2000, 3000, 4300, 5300, 6600]):
        gen.complete("generate", "engine", t0 + start, t0 + start + 1000, finished=[2 * v0 + index])
    for step, start in enumerate([2000, 4300, 6600]):
        train.complete("train_step", "step", t0 + start, t0 + start + 2000, step=v0 + step)
        train.complete("train_step", "step", t0 + start, t0 + start + 500, cat="phase", phase="forward",
                       step=v0 + step)
    for version, start in ((1, 4000), (2, 6300)):
        start += t0
        train.complete("sync_weights", "weights", start, start + 100, phase="publish", version=v0 + version)
        gen.complete("sync_weights", "weights", start + 100, start + 150, phase="receive", version=v0 + version)
        if loads:
            gen.complete("sync_weights", "weights", start + 150, start + 300, phase="load", version=v0 + version)
    gen.close(), train.close()
    merge_trace(tmp_path)
    return tmp_path


def test_calibration_is_measured_from_the_runs_trace_and_trajectories(tmp_path):
    plan, cal, _ = calibrate(_run_folder(tmp_path))
    assert cal.versions == 2
    assert cal.gen_s_per_token == pytest.approx(6000e-6 / 72)  # 6 engine steps up to group 5; 24 x 3 tokens
    assert cal.node_s_per_token == pytest.approx({"train_step": 6000e-6 / 216})  # 24 x (6 + 3); phases not added
    assert cal.sync_s == pytest.approx((200 + 400) / 2 * 1e-6)  # (publish + receive + load) / versions
    assert (cal.prompt_tokens, cal.response_tokens) == (6.0, 3.0)
    assert cal.response_log_sigma == pytest.approx(math.log(2) / 2)  # half the responses log 2, half log 4
    sim_plan, cost = calibrated_plan(plan, cal)
    assert cost.run_s(8, 0.0, 3) == pytest.approx(8 * 3 * 6000e-6 / 72)  # per live response per step
    assert cost.prefill_s(8) == 0.0 and sim_plan.sync_s == cal.sync_s and sim_plan.workload["prompt_len"] == 6


def test_measured_busy_is_over_the_simulators_window_and_sits_beside_the_prediction(tmp_path):
    c = compare(_run_folder(tmp_path))
    assert c.simulated.warmup == 1 and c.steps == 1  # S = 2 versions: window from v1's load (4300) to v2's (6600)
    assert c.window_s == pytest.approx(2300e-6) and c.measured_step_s == pytest.approx(2300e-6)
    assert c.measured == pytest.approx({"generate": 2000 / 2300, "train_step": 2000 / 2300,
                                        "sync_weights": 300 / 2300})
    assert set(c.predicted) == {"generate", "train_step", "sync_weights"}
    assert all(0.0 < v <= 1.0 for v in c.predicted.values())
    rows = {line.split()[0]: line.split()[1:] for line in format_comparison(c).splitlines()[3:]}
    assert rows["train_step"][1] == "87.0%" and rows["sync_weights"][1] == "13.0%"


def test_a_run_without_two_weight_loads_is_refused_naming_the_file(tmp_path):
    with pytest.raises(CalibrationError, match=r"trace\.json: 0 weight load\(s\) of 'sync_weights'"):
        compare(_run_folder(tmp_path, loads=False))


def test_timeline_simulate_prints_the_side_by_side_after_the_report(tmp_path, capsys):
    from areal_flow.cli import main

    assert main(["timeline", str(_run_folder(tmp_path)), "--simulate"]) == 0
    out = capsys.readouterr().out
    assert out.index("timeline over") < out.index("predicted (compiler.simulate, calibrated on this run's own trace)")
    assert "calibration, measured on this run: generation 0.083 ms per response token" in out  # 6000 µs / 72
    assert (tmp_path / "timeline.html").is_file()


@pytest.mark.parametrize("marked", [True, False])
def test_a_resumed_run_is_calibrated_on_its_last_attempt(tmp_path, marked, capsys):
    """Issue 17: versions start at the resume point (20), not at 1; the dead attempt's spans
    (and its load of version 21) and the steps before 20 stay out of the figures."""
    from areal_flow.cli import main

    folder = _run_folder(tmp_path, resumed_from=20, marked=marked)
    _, cal, _ = calibrate(folder)
    assert (cal.first_version, cal.versions) == (20, 2)
    assert cal.gen_s_per_token == pytest.approx(6000e-6 / 72)  # as in the first test: groups 40..45 trained
    assert cal.node_s_per_token == pytest.approx({"train_step": 6000e-6 / 216})
    assert cal.sync_s == pytest.approx((200 + 400) / 2 * 1e-6)
    assert (cal.prompt_tokens, cal.response_tokens) == (6.0, 3.0)
    c = compare(folder)
    assert c.simulated.warmup == 1 and c.steps == 1  # window from v21's load to v22's, 2300 µs
    assert c.window_s == pytest.approx(2300e-6)
    assert c.measured == pytest.approx({"generate": 2000 / 2300, "train_step": 2000 / 2300,
                                        "sync_weights": 300 / 2300})
    assert format_comparison(c).startswith("predicted (compiler.simulate, calibrated on this run's own trace) vs "
                                           "measured, versions 21..22 (1 steps, 0.00 s measured; the attempt "
                                           "resumed from version 20)")
    assert main(["timeline", str(folder), "--simulate"]) == 0
    assert "versions 21..22" in capsys.readouterr().out


def test_too_few_loads_in_a_resumed_run_names_the_last_attempt(tmp_path):
    """The dead attempt loaded version 21; the resumed one (attempt 2, from 20) loaded none:
    the refusal says the count is the last attempt's, so it does not read as the run's."""
    folder = _run_folder(tmp_path, loads=False, resumed_from=20)
    with pytest.raises(CalibrationError, match=r"trace\.json: 0 weight load\(s\) of 'sync_weights' in the last attempt "
                                               r"\(attempt 2, from version 20; .*\); the comparison needs at least 2"):
        compare(folder)
