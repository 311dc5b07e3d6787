"""Issue 24: a multi-rank trainer whose ranks lie on several machines runs on Ray as placed.

Three raylets on 127.0.0.1 (``ray.cluster_utils.Cluster``, each 1 CPU and one ``gpu_slot``
stand-in device; ``test_ray_scheduler`` says why the clusters stay on loopback) and the plan
``gen:d1 + train:d2``: generation on plan machine 0, the trainer's rank 0 on machine 1 (its
stage worker's actor) and rank 1 on machine 2 (a rank host actor, ``runtime.ray_ranks``),
joined in one gloo group over the nodes' IP. After the first checkpoint the rank host's actor
is killed: the driver restarts every worker from that checkpoint, and at k = 0 the run trains
the samples the local scheduler trains for the same plan, each once, every step once in
TensorBoard, and ends with the same weights bit for bit (the same two-rank gloo reductions in
the same order; resume is exact at k = 0).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from areal_flow.cli.run import run_experiment
from runs import records as trained_records
from runtime.checkpoint import latest_checkpoint
from test_ray_nodes import three_nodes  # noqa: F401 (a fixture)
from test_ray_scheduler import ARITH, _assert_cluster_clean, _assert_each_sample_trained_once, _config
from test_resume import _event_steps
from test_ray_scheduler import loopback_ray  # noqa: F401 (a fixture)

PLAN = ["cluster.n_nodes=3", "cluster.n_gpus_per_node=1", "compile.allocation=gen:d1 + train:d2",
        "train.checkpoint_every=1", "train.batch_size=2", "train.steps=4", "async.max_staleness=0"]


def _kill_rank_host_after_first_checkpoint(run: str, out, killed: dict) -> None:
    import ray

    deadline = time.monotonic() + 300
    while latest_checkpoint(out) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    ray.kill(ray.get_actor(f"{run}/train_step/0@n1", namespace="areal_flow"), no_restart=True)
    killed["at"] = time.monotonic()


@pytest.mark.slow
def test_a_trainer_on_two_machines_trains_as_the_local_scheduler_and_survives_a_killed_rank_host(
        tmp_path, three_nodes, capsys):  # noqa: F811 (the fixture imported above)
    head = three_nodes.head_node.node_id
    machine1, machine2 = sorted(three_nodes.worker_nodes, key=lambda n: n.node_id)  # plan order: by node id
    graph, cfg = _config(ARITH, tmp_path / "ray", *PLAN, "scheduler.device_resource=gpu_slot",
                         "scheduler.bind_host=node", f"scheduler.address={three_nodes.address}")
    killed: dict = {}
    threading.Thread(target=_kill_rank_host_after_first_checkpoint, daemon=True,
                     args=(cfg.name, tmp_path / "ray" / cfg.name, killed)).start()
    on_ray = run_experiment(graph, cfg, show_progress=False)
    assert killed, "the rank host was not killed"
    assert {name: p["node_id"] for name, p in on_ray["ray"]["placement"].items()} == {
        "generate/0": head, "train_step/0": machine1.node_id, "train_step/0@n1": machine2.node_id}
    err = capsys.readouterr().err
    died = next(line for line in err.splitlines() if "restarting every worker" in line)
    assert died.startswith("areal-flow: train_step/0 died (its ranks on train_step/0@n1 died: killed by `ray.kill`")
    assert on_ray["restarts"]["trainer_restarts"] == 1, on_ray["restarts"]
    assert on_ray["workers"]["train_step/0"]["world_size"] == 2

    graph, cfg = _config(ARITH, tmp_path / "local", *PLAN, "scheduler.type=local")
    run_experiment(graph, cfg, show_progress=False)
    runs = [tmp_path / where / cfg.name for where in ("ray", "local")]
    for out in runs:
        records = _assert_each_sample_trained_once(out, steps=4, batch=2, n=4)
        assert {r["staleness"] for r in records} == {0}
    ray_records, local_records = ({r["sample_id"]: r["output_ids"] for r in trained_records(out)} for out in runs)
    assert ray_records == local_records  # the same samples, resumed exactly
    assert [_event_steps(out) for out in runs] == [[0, 1, 2, 3]] * 2  # none lost or repeated over the restart
    ray_weights, local_weights = (load_file(out / "model" / "model.safetensors") for out in runs)
    assert ray_weights.keys() == local_weights.keys()
    assert all(torch.equal(ray_weights[k], local_weights[k]) for k in ray_weights)  # bit for bit
    _assert_cluster_clean(three_nodes.address)
