"""Issue 26: a Ray node lost mid-run. Three raylets on 127.0.0.1 (``ray.cluster_utils.Cluster``,
each 1 CPU and one ``gpu_slot`` stand-in device; see ``test_ray_scheduler`` for why the clusters
stay on loopback) and a two-machine plan, ``train:d1 + gen:d1``: the trainer on plan machine
0 (the head), generation on machine 1. Removing machine 1's node moves its devices to the
third node and the run ends with every sample trained once; removing that one too, with no
node left to stand in, stops the run with one line naming the node and the plan's devices.
Before that, the three machines run `gen:d2 + train:d1`: one generation replica on each of
machines 0 and 1 (the mesh `n0-1:g0`), the trainer on machine 2. Every wait is bounded.
"""

from __future__ import annotations

import threading
import time

import pytest

from areal_flow.cli.run import run_experiment
from runtime.checkpoint import latest_checkpoint
from test_ray_scheduler import _assert_cluster_clean, _assert_each_sample_trained_once, _config, ARITH
from test_ray_scheduler import loopback_ray  # noqa: F401 (a fixture)

TWO_MACHINES = ["cluster.n_nodes=2", "cluster.n_gpus_per_node=1", "scheduler.device_resource=gpu_slot",
                "compile.allocation=train:d1 + gen:d1", "scheduler.bind_host=node", "train.checkpoint_every=1",
                "train.batch_size=2", "async.max_staleness=0"]  # k = 0: generation cannot run ahead of a removal


@pytest.fixture
def three_nodes(loopback_ray):  # noqa: F811 (the fixture imported above)
    from ray.cluster_utils import Cluster

    args = {"num_cpus": 1, "resources": {"gpu_slot": 1}, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
    cluster.add_node(**args)
    cluster.add_node(**args)
    yield cluster
    cluster.shutdown()


def _remove_after_first_checkpoint(cluster, node, out, removed: dict) -> None:
    deadline = time.monotonic() + 300
    while latest_checkpoint(out) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    cluster.remove_node(node)
    removed["at"] = time.monotonic()


@pytest.mark.slow
def test_a_lost_node_moves_its_devices_to_a_spare_or_stops_naming_them(tmp_path, three_nodes, capsys):
    from runtime.ray_cluster import NodeLost

    head = three_nodes.head_node.node_id
    machine1, spare = sorted(three_nodes.worker_nodes, key=lambda n: n.node_id)  # plan order: by node id
    # 0. three machines, `gen:d2 + train:d1`: replica r on machine r (n0-1:g0), the trainer on n2
    graph, cfg = _config(ARITH, tmp_path, *TWO_MACHINES, "cluster.n_nodes=3", "compile.allocation=gen:d2 + train:d1",
                         "train.steps=2", "name=spread", f"scheduler.address={three_nodes.address}")
    placement = run_experiment(graph, cfg, show_progress=False)["ray"]["placement"]
    assert {name: p["node_id"] for name, p in placement.items()} == {
        "generate/0": head, "generate/1": machine1.node_id, "train_step/0": spare.node_id}
    _assert_each_sample_trained_once(tmp_path / "spread", steps=2, batch=2, n=4)
    # 1. machine 1's node lost after the first checkpoint: generation moves to the spare node
    graph, cfg = _config(ARITH, tmp_path, *TWO_MACHINES, "train.steps=4", "name=moved",
                         f"scheduler.address={three_nodes.address}")
    removed: dict = {}
    threading.Thread(target=_remove_after_first_checkpoint, daemon=True,
                     args=(three_nodes, machine1, tmp_path / "moved", removed)).start()
    summary = run_experiment(graph, cfg, show_progress=False)
    assert removed, "the node was not removed"
    err = capsys.readouterr().err
    assert summary["restarts"]["trainer_restarts"] == 1, (summary["restarts"], err)  # every worker from a checkpoint
    died = next(line for line in err.splitlines() if "restarting every worker" in line)
    assert died.startswith("areal-flow: generate/0 died (") and (
        f"; its node {machine1.node_id[:8]}@127.0.0.1 (plan machine n1) was lost); restarting every worker from "
        "version_") in died, died
    assert (f"Ray node {machine1.node_id[:8]}@127.0.0.1 (plan machine n1) was lost; the plan's devices n1:g0 move to "
            f"a spare node (n1 -> {spare.node_id[:8]})") in err
    placement = summary["ray"]["placement"]
    assert placement["generate/0"]["node_id"] == spare.node_id and placement["train_step/0"]["node_id"] == head
    records = _assert_each_sample_trained_once(tmp_path / "moved", steps=4, batch=2, n=4)
    assert {r["staleness"] for r in records} == {0}
    # 2. the spare lost as well: no node is left for n1:g0, the run stops naming both
    graph, cfg = _config(ARITH, tmp_path, *TWO_MACHINES, "train.steps=40", "name=stops",
                         f"scheduler.address={three_nodes.address}")
    removed.clear()
    threading.Thread(target=_remove_after_first_checkpoint, daemon=True,
                     args=(three_nodes, spare, tmp_path / "stops", removed)).start()
    with pytest.raises(NodeLost) as info:
        run_experiment(graph, cfg, show_progress=False)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"Ray node {spare.node_id[:8]}@127.0.0.1 (plan machine n1) "
                                                       "was lost and no other alive node offers")
    assert "the plan's devices n1:g0 can no longer be placed" in message
    assert time.monotonic() - removed["at"] < 60  # stops, never hangs
    _assert_cluster_clean(three_nodes.address)
