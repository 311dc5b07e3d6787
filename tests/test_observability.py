"""What a run says (issue 28 item 9): CPU plans speak of processes, not CUDA/NCCL; an
allocation that does not fit names the cluster that would hold it; a worker's traceback
names the graph file; a misspelled preset gets a did-you-mean; a resumed run's samples/s is
its own and its wall time every attempt's; start-up says what it is doing."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import pytest

from areal_flow.cli import flow_config, load_flow, main
from areal_flow.config_load import load_config
from areal_flow.models.names import ModelNameError, resolve_name
from compiler.program import compile_program
from compiler import format_table
from compiler.allocation import AllocationError
from compiler.mesh import fitting_clusters
from compiler.plan import decode_value
from runtime.metrics import WALL_FILE, RunLogger, format_summary

REPO = Path(__file__).resolve().parents[1]
GRAPH = REPO / "graphs/arith_grpo.py"


def _plan(*overrides: str):
    flow = load_flow(GRAPH)
    cfg = load_config(REPO / "graphs/arith_grpo.yaml", list(overrides))
    return compile_program(flow(cfg), cfg)


def test_a_cpu_plan_names_no_cuda_nccl_nvlink_or_hbm():
    cpu = format_table(_plan())
    for word in ("CUDA", "NCCL", "NVLink", "HBM"):
        assert word not in cpu, word
    assert "memory per worker process: usable 14.4 of 16.0 GiB" in cpu  # 0.9 x the cpu preset's 16 GiB
    gpu = format_table(_plan("cluster.gpu=H100"))
    assert "the rest for the CUDA context, NCCL buffers" in gpu and "NVLink" in gpu


def test_an_allocation_that_does_not_fit_names_the_cluster_that_would():
    # [2, 1] on 1 x 2: 3 devices per machine hold d2 at 0-1 and d1 at 2; two machines hold d2
    # (a whole machine) and d1 (the other machine's first device)
    assert fitting_clusters([2, 1], 1, 2) == (3, 2)
    assert fitting_clusters([2, 2], 1, 2) == (4, 2)
    assert fitting_clusters([8], 1, 4) == (8, 2)  # 5-7 per machine cannot hold 8; 8 can, as can 2 x 4
    assert fitting_clusters([3, 1], 1, 2) == (None, None)  # 3 is a whole machine of 3 or nothing
    with pytest.raises(AllocationError, match=r"do not fit 1 machine\(s\) x 2 devices .*\); it fits cluster.n_gpus_per_node=3 or "
                                              r"cluster.n_nodes=2\n  gen:d2 \+ train:d1"):
        _plan("compile.allocation=gen:d2 + train:d1")


def test_a_graph_files_code_keeps_its_file_name_on_the_worker(tmp_path):
    graph = tmp_path / "broken.py"
    graph.write_text("from areal_flow import Model, flow, ops\n\n\n"
                     "def reward_fn(text, answer):\n"
                     "    return 1.0 / 0\n\n\n"
                     "@flow\n"
                     "def broken(cfg):\n"
                     "    policy = Model('policy', cfg.model)\n"
                     "    r = ops.generate(policy, ops.dataset(cfg.dataset), n_samples=2, max_new_tokens=4)\n"
                     "    adv = ops.advantage(r, ops.reward(r, fn=reward_fn), estimator='grpo')\n"
                     "    stats = ops.train_step(policy, adv, algorithm='grpo')\n"
                     "    ops.sync_weights(policy, to=r)\n"
                     "    return stats\n")
    flow = load_flow(graph)
    cfg = flow_config(flow, type("Args", (), {"config": None, "overrides": []}))
    plan = compile_program(flow(cfg), cfg)
    fn = decode_value(plan.node("reward").attrs["fn"])  # as a worker gets it: by value, from the plan
    with pytest.raises(ZeroDivisionError) as info:
        fn("7", "7")
    frame = traceback.extract_tb(info.value.__traceback__)[-1]
    assert (frame.filename, frame.lineno, frame.line) == (str(graph), 5, "return 1.0 / 0")


def test_a_misspelled_preset_gets_a_did_you_mean():
    with pytest.raises(ModelNameError, match="did you mean 'tiny-arith'\\? presets: tiny-s, tiny-arith"):
        resolve_name("tiny-arth")
    with pytest.raises(ModelNameError, match="did you mean 'smollm2-135m'"):  # the GGUF preset, before the shape
        resolve_name("smollm2-135")
    with pytest.raises(ModelNameError) as info:
        resolve_name("xyz")
    assert "did you mean" not in str(info.value)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _step(step: int, samples: int) -> dict:
    return {"step": step, "samples": samples, "staleness": [0] * samples, "reward": 0.0, "staleness_mean": 0.0}


def test_a_resumed_run_rates_its_own_samples_and_sums_every_attempts_time(tmp_path, monkeypatch):
    import runtime.metrics as metrics

    clock = Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    first = RunLogger(tmp_path, total_steps=4, show_progress=False)
    for step in range(3):  # 3 steps of 128 samples in 30 s; the checkpoint holds 2 of them
        clock.now += 10.0
        first.log_step(_step(step, 128))
    first.close()
    assert json.loads((tmp_path / WALL_FILE).read_text()) == {"step": 2, "wall_s": 30.0}
    clock.now += 500.0  # down between the attempts: no RL time
    second = RunLogger(tmp_path, total_steps=4, show_progress=False, first_step=2)
    second.samples = second.earlier_samples = 256  # the rewind kept steps 0 and 1
    clock.now += 20.0
    second.log_step(_step(2, 128))
    assert second.bar.postfix.endswith("sps=6, stale=0.00")  # 128 samples in 20 s, not 384 in 20 s
    clock.now += 20.0
    second.log_step(_step(3, 128))
    second.close()
    summary = second.summary()
    assert (summary["wall_s"], summary["attempt_wall_s"], summary["samples_trained"]) == (70.0, 40.0, 512)
    assert "RL wall time: 70.0 s (this attempt 40.0 s)   samples trained: 512" in format_summary(summary)


def test_the_summary_names_each_engines_dtype_and_prompts_over_the_budget():
    workers = {"train_step/0": {"pid": 1},
               "generate/1": {"engine_dtype": "float32", "prompts_over_budget": 0, "longest_prompt": 7},
               "generate/0": {"engine_dtype": "bfloat16", "engine_dtype_speedup": 2.687,
                              "prompts_over_budget": 3, "longest_prompt": 46}}
    text = format_summary({"wall_s": 1.0, "samples_trained": 8, "staleness_histogram": {}, "workers": workers})
    assert "generation engines: generate/0 bfloat16 (auto: decode step 2.69x fp32's), generate/1 float32\n" in text
    assert "prompts longer than the plan's budget (compile.max_prompt_len): generate/0 3 (longest 46 tokens)\n" in text
    quiet = format_summary({"wall_s": 1.0, "samples_trained": 8, "staleness_histogram": {},
                            "workers": {"generate/0": {"engine_dtype": "float32"}}})
    assert "generation engines: generate/0 float32\n" in quiet and "budget" not in quiet
    many = {f"generate/{i}": {"engine_dtype": "float32"} for i in (10, 2, 1)}
    text = format_summary({"wall_s": 1.0, "samples_trained": 8, "staleness_histogram": {}, "workers": many})
    assert "generation engines: generate/1 float32, generate/2 float32, generate/10 float32\n" in text


def test_the_summary_says_how_the_idle_cores_were_lent():
    workers = {"train_step/0": {"core_lending": {"own_threads": 1, "lent_s": 2.04, "phases": 720, "borrowed": 312,
                                                 "most_threads": 2}},
               "generate/0": {"core_lending": {"own_threads": 1, "lent_s": 48.31, "phases": 0, "borrowed": 0,
                                               "most_threads": 0}}}
    text = format_summary({"wall_s": 1.0, "samples_trained": 8, "staleness_histogram": {}, "workers": workers})
    assert ("idle cores lent (scheduler.lend_idle_cores): generate/0 lent its 1 thread(s) 48.3 s, train_step/0 ran "
            "312 of 720 phases on lent threads (own 1, at most 2), lent its own 2.0 s\n") in text
    plain = format_summary({"wall_s": 1.0, "samples_trained": 8, "staleness_histogram": {}, "workers": {}})
    assert "idle cores" not in plain

def test_start_up_says_what_it_is_doing(monkeypatch, capsys, tmp_path):
    import areal_flow.cli.run as cli_run
    import runtime.model_source as model_source
    from runtime.run_setup import RunSetup

    monkeypatch.setattr(cli_run, "run_experiment", lambda graph, cfg, show_progress=True: {})
    assert main(["run", str(GRAPH), "train.steps=1"]) == 0
    assert capsys.readouterr().err == ""  # not a terminal: nothing before a possible one-line error
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["run", str(GRAPH), "train.steps=1"]) == 0
    assert "areal-flow: run arith_grpo: loading the runtime (torch) and compiling the plan" in capsys.readouterr().err
    setup = RunSetup.create(_plan(f"out_dir={tmp_path}", "eval.n_test=7"), show_progress=True)
    monkeypatch.setattr(model_source, "prepare_models", lambda plan, task, progress=False: {"policy": "nowhere"})
    monkeypatch.setattr(RunSetup, "_held_out", lambda self, folder, when: self.extra.update(
        accuracy_before=0.5, eval_kind="greedy accuracy"))
    setup.prepare()
    err = capsys.readouterr().err
    assert "areal-flow: preparing the start models (tiny-arith)..." in err
    assert "areal-flow: held-out evaluation before RL (7 problems)..." in err
    logger = RunLogger(tmp_path, total_steps=1, show_progress=False)
    logger.note("starting 2 worker processes (torch, models)")
    assert logger.bar.postfix == "starting 2 worker processes (torch, models)"
    logger.log_step(_step(0, 4))  # the step's figures replace the note
    assert logger.bar.postfix.startswith("reward=0.00")
    logger.close()
