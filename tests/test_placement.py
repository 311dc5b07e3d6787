"""Issue 24: devices as placed. Each local worker gets exactly its mesh's devices (CUDA:
CUDA_VISIBLE_DEVICES; CPU with scheduler.cpu_pinning: its cores). Expected values by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compiler.mesh import MeshSpec
from runtime.placement import pinned_cores, visible_gpus, worker_devices

REPO = Path(__file__).resolve().parents[1]


def test_replicas_split_their_mesh_and_other_groups_take_all_of_it():
    gen = MeshSpec(first_node=0, n_nodes=1, first_device=0, n_devices=2)  # gen:d2 on n0:g0-1
    assert worker_devices(gen, replicas=2, rank=0) == (0,) and worker_devices(gen, 2, 1) == (1,)
    train = MeshSpec(first_node=0, n_nodes=1, first_device=2, n_devices=2)  # train:d2 on n0:g2-3
    assert worker_devices(train, replicas=1, rank=0) == (2, 3)
    tp = MeshSpec(first_node=0, n_nodes=1, first_device=4, n_devices=4)  # gen:d2t2 on n0:g4-7
    assert worker_devices(tp, 2, 1) == (6, 7)
    with pytest.raises(ValueError, match="3 device"):
        worker_devices(MeshSpec(0, 1, 0, 3), replicas=2, rank=0)


def test_gpus_compose_with_the_drivers_own_visible_devices():
    assert visible_gpus((1, 2), None) == "1,2"  # gen:d1 + train:d2 on 3 GPUs: the trainer sees GPUs 1 and 2
    assert visible_gpus((1, 2), "") == "1,2"
    assert visible_gpus((0, 2), "4,5,6") == "4,6"  # the driver was given GPUs 4-6: plan device i is its i-th
    with pytest.raises(ValueError, match="sees 2 GPU"):
        visible_gpus((2,), "0,1")


def test_one_core_per_device_wrapping_when_there_are_fewer_cores():
    assert pinned_cores((0,), {0, 1}) == {0} and pinned_cores((1,), {0, 1}) == {1}
    assert pinned_cores((2,), {0, 1}) == {0}  # a third CPU device on a 2-core machine shares core 0
    assert pinned_cores((0, 1), {4, 7, 9}) == {4, 7}  # the allowed cores, sorted


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_a_placed_process_sees_its_devices_only():
    code = ("import json, os; from runtime.placement import place_process; "
            "cpu = place_process((1,), 'cpu', True); gpu = place_process((0, 2), 'cuda', False); "
            "print(json.dumps([cpu, gpu, sorted(os.sched_getaffinity(0)), os.environ['CUDA_VISIBLE_DEVICES']]))")
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "3,5,7"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    cpu, gpu, affinity, visible = json.loads(out.stdout)
    allowed = sorted(os.sched_getaffinity(0))
    assert cpu == {"devices": [1], "cores": [allowed[1 % len(allowed)]]} and affinity == cpu["cores"]
    assert gpu == {"devices": [0, 2], "cuda_visible_devices": "3,7"} and visible == "3,7"


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_the_local_scheduler_pins_each_worker_to_its_meshs_cores(tmp_path, warm_cache):
    """`gen:d1 + train:d1` with scheduler.cpu_pinning: the replica on device 0's core, the
    trainer on device 1's, each with one torch thread; what each worker reports it was given."""
    from runs import cli_run

    cli_run(REPO / "graphs/arith_grpo.py", "train.steps=2", "train.batch_size=2", "gen.n_samples=4",
            "warm_start.steps=10", "eval.enabled=false", "scheduler.cpu_pinning=true", "cluster.n_gpus_per_node=2",
            "compile.allocation=gen:d1 + train:d1", f"out_dir={tmp_path}", "name=pinned")
    workers = json.loads((tmp_path / "pinned" / "summary.json").read_text())["workers"]
    allowed = sorted(os.sched_getaffinity(0))
    assert workers["generate/0"]["placement"] == {"devices": [0], "cores": [allowed[0]]}
    assert workers["train_step/0"]["placement"] == {"devices": [1], "cores": [allowed[1 % len(allowed)]]}
