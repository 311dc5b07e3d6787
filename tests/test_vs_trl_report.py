"""bench/vs_trl_report.py: which runs' time to accuracy is compared (each areal-flow variant with
each TRL variant, and a TRL run of other samples with its twin, the noise control) and the
tally over seeds, on curves written by hand."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # vs_trl_report imports its siblings as the scripts do

from bench.vs_trl_jobs import variants  # noqa: E402
from bench.vs_trl_report import reach_pairs, tally  # noqa: E402


def test_areal_runs_meet_every_base_trl_run_and_each_trl_twin_meets_its_base():
    runs = variants(["2"], [""], [0], [False, True], trl_rngs=(0, 1))
    pairs = [(a.label, b.label) for a, b in reach_pairs(runs)]
    assert pairs == [("areal k=2", "TRL fp32"), ("areal k=2", "TRL bf16"),
                     ("TRL fp32 rng+1", "TRL fp32"), ("TRL bf16 rng+1", "TRL bf16")]


def test_tally_counts_reaching_in_time_for_areal_and_by_the_last_step_for_a_twin(capsys):
    runs = variants(["2"], [""], [0], [False], trl_rngs=(0, 1))
    trl = {1: [(200, 20.0, 0.80), (400, 40.0, 0.90)], 2: [(200, 20.0, 0.80), (400, 40.0, 0.85)]}
    areal = {1: [(200, 9.0, 0.86), (400, 18.0, 0.91), (600, 27.0, 0.89)],  # reaches 0.90 at 18 s <= 40 s
             2: [(200, 9.0, 0.80), (400, 18.0, 0.83), (600, 45.0, 0.86)]}  # 0.86 only at 45 s > 40 s
    twin = {1: [(200, 21.0, 0.84), (400, 41.0, 0.92)],  # reaches 0.90 at step 400 (41 s: as fast, by step)
            2: [(200, 21.0, 0.82), (400, 41.0, 0.84)]}  # never reaches 0.85
    results = {}
    for seed in (1, 2):
        results[(seed, "areal k=2")] = [{"curve": areal[seed]}]
        results[(seed, "TRL fp32")] = [{"curve": trl[seed]}]
        results[(seed, "TRL fp32 rng+1")] = [{"curve": twin[seed]}]
    results[(3, "areal k=2")] = [{"curve": [(200, 50.0, 0.95)]}]  # its only point after TRL's 40 s
    results[(3, "TRL fp32")] = [{"curve": trl[1]}]
    results[(3, "TRL fp32 rng+1")] = [{"curve": twin[1]}]
    tally(runs, results)
    out = capsys.readouterr().out
    # seed 3: areal reached 0.90 only after TRL's time (not counted) and has no point within it (left out)
    assert "areal k=2 -> TRL fp32's final: 1 of 3; best within its time -0.5 points on average (1 with no point " \
        "within it, left out of the mean)" in out
    # areal: seed 1 best within 40 s is 0.91 (+1 point), seed 2 0.83 (-2 points): mean -0.5
    # twin, by step (<= 400): seed 1 best 0.92 (+2 points), seed 2 0.84 (-1), seed 3 as seed 1 (+2): mean +1.0
    assert "TRL fp32 rng+1 -> TRL fp32's final: 2 of 3; best within its time +1.0 points" in out
