"""reward_analysis on a small synthetic trajectory dump with hand-computed statistics."""

from __future__ import annotations

import json
import math

import pytest

from areal_flow.debug.reward_analysis import analyze, load_trajectories, main


def _record(i, group_id, prompt, reward, step, staleness, length, finish="stop"):
    return {"sample_id": f"{group_id}:{i}", "group_id": group_id, "prompt_text": prompt,
            "output_text": "x " * length, "output_ids": list(range(length)), "reward": reward,
            "versions": [0] * length, "behavior_logprobs": [-1.0] * length, "finish_reason": finish,
            "meta": {"answer": "1"}, "step": step, "staleness": staleness}


def _dump(folder):
    """Prompt A: 1,0,0,1 at step 0 and 1,1 at step 1; B: 0,0 at step 0; C: 1,1,1 at step 1."""
    step0 = [_record(0, 0, "A", 1.0, 0, 0, 4), _record(1, 0, "A", 0.0, 0, 0, 8, "length"),
             _record(2, 0, "A", 0.0, 0, 0, 8, "length"), _record(3, 0, "A", 1.0, 0, 0, 4),
             _record(0, 1, "B", 0.0, 0, 0, 8, "length"), _record(1, 1, "B", 0.0, 0, 0, 8, "length")]
    step1 = [_record(0, 2, "C", 1.0, 1, 1, 2), _record(1, 2, "C", 1.0, 1, 1, 2), _record(2, 2, "C", 1.0, 1, 1, 2),
             _record(0, 3, "A", 1.0, 1, 2, 4), _record(1, 3, "A", 1.0, 1, 2, 4)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "step_000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in step0))
    (folder / "step_001.jsonl").write_text("\n".join(json.dumps(r) for r in step1) + "\n\n")
    return folder


def test_pass_rates_and_groupings(tmp_path):
    records = load_trajectories(_dump(tmp_path / "traj"))
    assert len(records) == 11
    report = analyze(records)
    # A: 1+0+0+1+1+1 = 4 passes of 6; B: 0 of 2; C: 3 of 3
    assert report.by_prompt["A"].pass_rate == pytest.approx(4 / 6)
    assert (report.by_prompt["B"].pass_rate, report.by_prompt["C"].pass_rate) == (0.0, 1.0)
    assert [s.n for s in report.by_prompt.values()] == [6, 2, 3]
    assert report.prompt_pass_histogram == {"all_fail": 1, "mixed": 1, "all_pass": 1}
    # step 0: rewards 1,0,0,1,0,0 -> mean 2/6, std sqrt(2/6 * 4/6) = sqrt(8)/6; step 1: five 1s
    assert report.by_step[0].mean == pytest.approx(1 / 3)
    assert report.by_step[0].std == pytest.approx(math.sqrt(8) / 6)
    assert (report.by_step[1].mean, report.by_step[1].std, report.by_step[1].n) == (1.0, 0.0, 5)
    # staleness 0: the six step-0 samples (mean 1/3); 1: C's three; 2: A's two at step 1
    assert {k: (s.n, s.mean) for k, s in report.by_staleness.items()} == {
        0: (6, pytest.approx(1 / 3)), 1: (3, 1.0), 2: (2, 1.0)}
    # every "length"-truncated sample failed; the 7 "stop" samples all passed
    assert {k: (s.n, s.pass_rate) for k, s in report.by_finish_reason.items()} == {
        "length": (4, 0.0), "stop": (7, 1.0)}
    # lengths span 2..8 -> 8 bins of width ceil(7 / 8) = 1: [2,3) 3 samples, [4,5) 4, [8,9) 4
    assert {b: s.n for b, s in report.by_length_bin.items()} == {(2, 3): 3, (4, 5): 4, (8, 9): 4}


def test_length_reward_correlation():
    # lengths 1,2,3 vs rewards 0,0,1: sxy = 1, sxx = 2, syy = 2/3 -> r = 1 / sqrt(4/3) = sqrt(3)/2
    records = [_record(i, i, f"p{i}", r, 0, 0, n) for i, (r, n) in enumerate([(0.0, 1), (0.0, 2), (1.0, 3)])]
    assert analyze(records).length_reward_corr == pytest.approx(math.sqrt(3) / 2)
    constant = [_record(i, i, "p", 1.0, 0, 0, 2 + i) for i in range(3)]
    assert math.isnan(analyze(constant).length_reward_corr)  # constant reward: undefined


def test_cli_prints_summary_and_writes_png(tmp_path, capsys):
    folder = _dump(tmp_path / "traj")
    assert main(["--trajectory", str(folder), "--plot"]) == 0
    png = folder / "reward_analysis.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "11 trajectories, 3 prompts" in out and "all fail: 1, mixed: 1, all pass: 1" in out
    assert main(["--trajectory", str(folder / "step_001.jsonl")]) == 0  # a single file works too
    assert "5 trajectories, 2 prompts" in capsys.readouterr().out


def test_no_trajectories_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no \\*.jsonl"):
        load_trajectories(tmp_path / "empty")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="no trajectories"):
        load_trajectories(tmp_path / "blank.jsonl")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_trajectories(tmp_path / "nowhere")
    assert main(["--trajectory", str(tmp_path / "empty")]) == 2
    assert "no *.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line, message",
    [("{oops", "not valid JSON"), ('{"sample_id": "0:0"}', "lacks field"),
     (json.dumps({**_record(0, 0, "A", 1.0, 0, 0, 1), "reward": None}), "reward must be a finite number")],
)
def test_bad_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_record(0, 0, "A", 1.0, 0, 0, 1)) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        load_trajectories(path)
    assert f"{path}:2" in str(info.value)


def test_smoothed_band_is_clipped_to_the_reward_range():
    from areal_flow.debug.reward_analysis import smoothed_band

    # step 1: rewards 1, 1, 1, 0 -> mean 0.75, sd sqrt(3/16) = 0.4330, half = 1.96 * 0.4330 / 2 = 0.4244
    # step 2: all 1 -> mean 1, sd 0: band [1, 1]; with window 0 each step stands alone
    records = [{"step": 1, "reward": r} for r in (1, 1, 1, 0)] + [{"step": 2, "reward": 1} for _ in range(4)]
    steps, means, lows, highs = smoothed_band(records, window=0, lo=0.0, hi=1.0)
    assert steps == [1, 2] and means == [0.75, 1.0]
    assert lows[0] == pytest.approx(0.75 - 0.42435, abs=1e-4) and highs[0] == 1.0  # 1.174 clipped to 1
    assert (lows[1], highs[1]) == (1.0, 1.0)
    # window 1 pools both steps: 7 ones and a zero -> mean 7/8
    assert smoothed_band(records, window=1, lo=0.0, hi=1.0)[1] == [0.875, 0.875]


def test_staleness_within_steps_removes_the_time_trend():
    from areal_flow.debug.reward_analysis import staleness_within_steps

    # early step 1: low reward, staleness 0 and 1 alike; late step 2: high reward, all staleness 2.
    # Raw means by staleness would say 0/1 -> 0.25, 2 -> 1.0 (time, not staleness).
    records = [{"step": 1, "staleness": 0, "reward": 0.0}, {"step": 1, "staleness": 0, "reward": 0.5},
               {"step": 1, "staleness": 1, "reward": 0.0}, {"step": 1, "staleness": 1, "reward": 0.5},
               {"step": 2, "staleness": 2, "reward": 1.0}, {"step": 2, "staleness": 2, "reward": 1.0}]
    # step 1 mean 0.25: staleness 0 deviations -0.25, +0.25 -> 0; same for 1; step 2 has one value: left out
    assert staleness_within_steps(records) == {0: (0.0, 2), 1: (0.0, 2)}
