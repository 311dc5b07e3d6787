"""``scheduler.type=ray``: a local Ray cluster, two Ray nodes on one machine, a generation
actor killed mid-run, Ctrl-C, and the clear errors (unreachable address, cluster too small).

Every cluster here lives on 127.0.0.1 only. Ray 2.60 replaces a loopback address given to
``ray.init`` (``_node_ip_address`` or a ``127.0.0.1:PORT`` cluster address) with the
machine's outward IP; the ``loopback_ray`` fixture turns that rewrite off for the test
process (``ray._private.services.resolve_ip_for_localhost``), since this machine may use
loopback only. Token authentication (on by default for local clusters in Ray 2.60) stays
on: every cluster started here writes and reads the same ``~/.ray/auth_token``.

The accounting checks read the trajectories JSONL the trainer writes: with ``S`` steps,
``B`` groups per step and ``n`` samples per group, exactly ``S*B*n`` unique sample ids, the
group with admission index ``i`` trained at step ``i // B``.
"""

from __future__ import annotations

import _thread
import math
import os
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import cloudpickle
import pytest

from areal_flow.cli import load_flow
from areal_flow.config_load import load_config
from areal_flow.cli.run import run_experiment
from runs import records as trained_records

REPO = Path(__file__).resolve().parents[1]
ARITH = REPO / "graphs" / "arith_grpo.py"
TINY = ["scheduler.type=ray", "scheduler.node_ip=127.0.0.1", "warm_start.steps=10", "eval.enabled=false",
        "gen.n_samples=4"]

GRAPH_WITH_OWN_REWARD = '''
from areal_flow import Model, flow, ops
from areal_flow.tasks.arithmetic import ArithmeticTask


def own_reward(output_text, answer):  # defined here: workers cannot import this file
    return ArithmeticTask.reward(output_text, answer)


@flow
def own_reward_grpo(cfg):
    policy = Model("policy", cfg.model)
    rollout = ops.generate(policy, ops.dataset(cfg.dataset), n_samples=cfg.gen.n_samples,
                           max_new_tokens=cfg.gen.max_new_tokens, temperature=cfg.gen.temperature, top_p=cfg.gen.top_p)
    adv = ops.advantage(rollout, ops.reward(rollout, fn=own_reward), estimator="grpo")
    stats = ops.train_step(policy, adv, algorithm=cfg.train.algorithm, max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats
'''


@pytest.fixture(scope="module")
def loopback_ray():
    """Keep Ray on 127.0.0.1 (module doc) and share the repository's warm-start cache."""
    import ray._private.services as services

    mp = pytest.MonkeyPatch()
    mp.setattr(services, "resolve_ip_for_localhost", lambda host: host)
    mp.setenv("AREAL_FLOW_CACHE", os.environ.get("AREAL_FLOW_CACHE", str(REPO / ".cache" / "areal_flow")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def two_nodes(loopback_ray):
    """Two raylets on 127.0.0.1, each with 1 CPU and one custom ``gpu_slot`` (a stand-in GPU)."""
    from ray.cluster_utils import Cluster

    args = {"num_cpus": 1, "resources": {"gpu_slot": 1}, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
    cluster.add_node(**args)
    yield cluster
    cluster.shutdown()


def _config(graph_file: Path, tmp_path: Path, *overrides: str):
    fl = load_flow(graph_file)
    cfg = load_config(ARITH.with_suffix(".yaml"), [*TINY, f"out_dir={tmp_path}", f"name={fl.name}", *overrides])
    return fl(cfg), cfg


def _assert_each_sample_trained_once(out: Path, steps: int, batch: int, n: int) -> list[dict]:
    records = trained_records(out)
    ids = [r["sample_id"] for r in records]
    assert len(ids) == steps * batch * n and len(set(ids)) == len(ids)
    per_group = Counter(r["group_id"] for r in records)
    assert per_group == {i: n for i in range(steps * batch)}  # every admission index, n samples each
    assert all(r["step"] == r["group_id"] // batch for r in records)
    return records


def _assert_cluster_clean(address: str) -> None:
    """No actor of ours alive and every placement group removed."""
    import ray

    ray.init(address=address, _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        assert ray.util.list_named_actors(all_namespaces=True) == []
        assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    finally:
        ray.shutdown()


def _wait_for(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.05)


# ------------------------------------------------------------------------- fast
def test_graph_file_functions_travel_by_value(tmp_path):
    path = tmp_path / "own_reward_graph.py"
    path.write_text(GRAPH_WITH_OWN_REWARD)
    fl = load_flow(path)
    fn = fl(load_config(None)).nodes_of("reward")[0].attrs["fn"]
    blob = cloudpickle.dumps(fn)
    del sys.modules[fn.__module__]  # as on a worker: the graph module cannot be imported there
    assert cloudpickle.loads(blob)(" 12", "12") == 1.0


def test_a_cluster_started_here_declares_the_plans_cpu_devices(monkeypatch):
    """Issue 24: `gen:d2 + train:d1` on a 2-core machine was refused ("offers 0 such node(s)")
    while the local scheduler runs it: the local cluster now declares max(cores, devices) CPUs."""
    import ray

    from areal_flow.config import ExperimentConfig
    from runtime.ray_cluster import connect

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cfg = ExperimentConfig()
    cfg.cluster.n_gpus_per_node = 3
    connect(cfg)
    assert seen["num_cpus"] == 3 and seen["address"] == "local"
    cfg.cluster.n_gpus_per_node = 1
    connect(cfg)
    assert seen["num_cpus"] == 2  # never fewer than the cores
    cfg.cluster.gpu, cfg.cluster.n_gpus_per_node = "H100", 3
    connect(cfg)
    assert seen["num_cpus"] is None  # GPU devices: Ray counts the CPUs itself


def test_unreachable_address_is_a_clear_error(tmp_path, loopback_ray):
    import ray

    from runtime.ray_cluster import RayClusterUnreachable

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    graph, cfg = _config(ARITH, tmp_path, f"scheduler.address=127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(RayClusterUnreachable, match=f"scheduler.address='127.0.0.1:{port}'.*ray start --head"):
        run_experiment(graph, cfg, show_progress=False)
    assert time.monotonic() - started < 10 and not ray.is_initialized()


# ------------------------------------------------------------------------- slow
@pytest.mark.slow
@pytest.mark.ci
def test_local_cluster_trains_every_sample_once(tmp_path, loopback_ray):
    import psutil
    import ray

    # three plan devices on a 2-core machine (issue 24): the cluster started here declares them
    graph, cfg = _config(ARITH, tmp_path, "train.steps=3", "train.batch_size=4", "train.checkpoint_every=1",
                         "cluster.n_gpus_per_node=3", "compile.allocation=gen:d2 + train:d1")
    summary = run_experiment(graph, cfg, show_progress=False)  # no address: a local cluster
    assert not ray.is_initialized()
    def ray_processes():  # the cluster started for the run: GCS, raylet, agents, actors
        return [p for p in psutil.Process().children(recursive=True)
                if p.status() != psutil.STATUS_ZOMBIE and any(k in " ".join(p.cmdline()) for k in ("ray", "gcs_server"))]

    _wait_for(lambda: not ray_processes(), timeout_s=10)
    out = tmp_path / "arith_grpo"
    _assert_each_sample_trained_once(out, steps=3, batch=4, n=4)
    assert summary["samples_trained"] == 3 * 4 * 4 == summary["workers"]["train_step/0"]["consumed"]
    assert summary["staleness_histogram"] and max(summary["staleness_histogram"]) <= 2  # k = 2 (yaml)
    ray_info = summary["ray"]
    assert ray_info["address"] == "local"
    placement = ray_info["placement"]
    assert placement["generate/0"]["mesh"] == placement["generate/1"]["mesh"] == "n0:g0-1"
    assert placement["train_step/0"]["mesh"] == "n0:g2"
    assert {p["ip"] for p in ray_info["placement"].values()} == {"127.0.0.1"}
    assert Path(ray_info["last_checkpoint"]) == out / "checkpoints" / "version_3"
    assert (out / "checkpoints" / "version_1" / "config.json").is_file() and (out / "model" / "config.json").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(out.glob("events*"))))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)


@pytest.mark.slow
def test_user_algorithm_and_estimator_reach_ray_actors_by_value(tmp_path, loopback_ray):
    from user_algorithm import check_user_run, write_user_graph

    graph, cfg = _config(write_user_graph(tmp_path), tmp_path, "train.steps=2", "train.batch_size=2")
    run_experiment(graph, cfg, show_progress=False)  # a local cluster; the actors never see the graph file
    check_user_run(tmp_path / "user_grpo", steps=2)


@pytest.mark.slow
def test_two_nodes_generation_and_training_apart(tmp_path, two_nodes):
    """The plan's machine index decides the Ray node: `train:d1 + gen:d1` on 2 machines puts
    the trainer on n0:g0 (the head) and generation on n1:g0 (the other raylet); the weights
    and the groups cross between them over `scheduler.bind_host=node`."""
    path = tmp_path / "own_reward_graph.py"
    path.write_text(GRAPH_WITH_OWN_REWARD)  # its reward function reaches the actor by value
    graph, cfg = _config(path, tmp_path, "train.steps=2", "train.batch_size=2", "cluster.n_nodes=2",
                         "cluster.n_gpus_per_node=1", "scheduler.device_resource=gpu_slot",
                         "compile.allocation=train:d1 + gen:d1", "scheduler.bind_host=node",
                         f"scheduler.address={two_nodes.address}")
    summary = run_experiment(graph, cfg, show_progress=False)
    records = _assert_each_sample_trained_once(tmp_path / "own_reward_grpo", steps=2, batch=2, n=4)
    assert {r["reward"] for r in records} <= {0.0, 1.0}  # scored by own_reward
    assert max(r["staleness"] for r in records) <= 2  # k = 2 (yaml)
    placement = summary["ray"]["placement"]
    (other,) = two_nodes.worker_nodes
    assert placement["train_step/0"]["node_id"] == two_nodes.head_node.node_id  # plan machine 0
    assert placement["generate/0"]["node_id"] == other.node_id  # plan machine 1
    assert placement["train_step/0"]["mesh"] == "n0:g0" and placement["generate/0"]["mesh"] == "n1:g0"
    assert summary["samples_trained"] == 2 * 2 * 4
    _assert_cluster_clean(two_nodes.address)


@pytest.mark.slow
def test_cluster_too_small_fails_before_any_work(tmp_path, two_nodes):
    from runtime.ray_cluster import ClusterMismatchError

    graph, cfg = _config(ARITH, tmp_path, "cluster.n_nodes=3", "cluster.n_gpus_per_node=1",
                         "scheduler.device_resource=gpu_slot", f"scheduler.address={two_nodes.address}")
    with pytest.raises(ClusterMismatchError, match=r"cluster.n_nodes=3 .* offers 2 such node"):
        run_experiment(graph, cfg, show_progress=False)
    assert not (tmp_path / "arith_grpo" / "trajectories").exists()


@pytest.mark.slow
def test_killed_generation_actor_restarts_and_no_group_is_lost(tmp_path, two_nodes):
    import ray

    from runtime.ray_scheduler import NAMESPACE

    # k = 0: step s trains exactly the groups generated with version s, so after step 0 the
    # replica still has steps 1-3 to produce when it is killed.
    graph, cfg = _config(ARITH, tmp_path, "train.steps=4", "train.batch_size=2", "async.max_staleness=0",
                         "cluster.n_nodes=2", "cluster.n_gpus_per_node=1", "scheduler.device_resource=gpu_slot",
                         f"scheduler.address={two_nodes.address}")
    log = tmp_path / "arith_grpo" / "trajectories" / "trajectories.jsonl"

    def kill_after_first_step():
        _wait_for(lambda: log.is_file() and log.read_text().strip())
        ray.kill(ray.get_actor(f"{cfg.name}/generate/0", namespace=NAMESPACE), no_restart=False)

    killer = threading.Thread(target=kill_after_first_step, daemon=True)
    killer.start()
    summary = run_experiment(graph, cfg, show_progress=False)
    killer.join(timeout=5)
    assert summary["restarts"]["replica_restarts"] == 1 and summary["restarts"]["trainer_restarts"] == 0
    records = _assert_each_sample_trained_once(tmp_path / "arith_grpo", steps=4, batch=2, n=4)
    assert {r["staleness"] for r in records} == {0}  # the restarted replica resumed at the trainer's version
    assert summary["workers"]["train_step/0"]["resyncs"] == 1


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_names_the_checkpoint(tmp_path, two_nodes, capsys):
    graph, cfg = _config(ARITH, tmp_path, "train.steps=40", "train.batch_size=2", "train.checkpoint_every=1",
                         "cluster.n_nodes=2", "cluster.n_gpus_per_node=1", "scheduler.device_resource=gpu_slot",
                         f"scheduler.address={two_nodes.address}")
    second = tmp_path / "arith_grpo" / "checkpoints" / "version_2" / "config.json"  # step 0's metrics are out by then

    def interrupt():
        _wait_for(second.is_file, timeout_s=300)  # actors start slowly on a loaded machine
        _thread.interrupt_main()

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run_experiment(graph, cfg, show_progress=False)
    err = capsys.readouterr().err
    assert "interrupted after" in err
    assert f"last checkpoint: {tmp_path / 'arith_grpo' / 'checkpoints' / 'version_'}" in err
    _assert_cluster_clean(two_nodes.address)


@pytest.mark.slow
def test_taken_devices_fail_before_any_work(tmp_path, two_nodes):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from runtime.ray_cluster import ClusterMismatchError

    graph, cfg = _config(ARITH, tmp_path, "cluster.n_nodes=2", "cluster.n_gpus_per_node=1",
                         "scheduler.device_resource=gpu_slot", "scheduler.placement_timeout_s=1")
    ray.init(address=two_nodes.address, _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:  # another job holds one of the two gpu_slots; the run reuses this connection
        other = placement_group([{"gpu_slot": 1}])
        ray.get(other.ready(), timeout=30)
        with pytest.raises(ClusterMismatchError, match=r"not placed within 1 s .*scheduler.placement_timeout_s"):
            run_experiment(graph, cfg, show_progress=False)
        assert ray.is_initialized()  # a connection it did not open stays open
        assert not (tmp_path / "arith_grpo" / "trajectories").exists()
        remove_placement_group(other)
        assert ray.util.list_named_actors(all_namespaces=True) == []
        states = {pg["name"]: pg["state"] for pg in ray.util.placement_group_table().values()}
        assert all(state == "REMOVED" for name, state in states.items() if name.startswith("areal_flow/"))
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def four_slots(loopback_ray):
    """One raylet on 127.0.0.1 with 2 CPUs and four ``gpu_slot`` stand-in devices."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"gpu_slot": 4},
                                                            "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    yield cluster
    cluster.shutdown()


def _losses(out: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(out.glob("events*"))))
    events.Reload()
    return [e.value for e in events.Scalars("train/loss")]


@pytest.mark.slow
def test_dp2_trainer_and_two_replicas_on_ray_match_local(tmp_path, four_slots):
    """The same plan (gen:d2 + train:d2, k = 0) on Ray and locally: the same groups reach the
    same replicas in the same order, so the runs train the same samples and their losses
    agree to fp32 reduction order."""
    shared = ("train.steps=3", "train.batch_size=2", "async.max_staleness=0", "cluster.n_gpus_per_node=4",
              "compile.allocation=gen:d2 + train:d2")
    graph, cfg = _config(ARITH, tmp_path / "ray", *shared, "scheduler.device_resource=gpu_slot",
                         f"scheduler.address={four_slots.address}")
    on_ray = run_experiment(graph, cfg, show_progress=False)
    graph, cfg = _config(ARITH, tmp_path / "local", *shared, "scheduler.type=local")
    local = run_experiment(graph, cfg, show_progress=False)
    for summary, out in ((on_ray, tmp_path / "ray" / "arith_grpo"), (local, tmp_path / "local" / "arith_grpo")):
        records = _assert_each_sample_trained_once(out, steps=3, batch=2, n=4)
        assert {r["staleness"] for r in records} == {0}
        assert summary["workers"]["train_step/0"]["world_size"] == 2
    assert {"generate/0", "generate/1"} <= set(local["workers"])
    assert set(on_ray["ray"]["placement"]) == {"generate/0", "generate/1", "train_step/0"}
    ray_records = {r["sample_id"]: r["output_ids"] for r in trained_records(tmp_path / "ray" / "arith_grpo")}
    local_records = {r["sample_id"]: r["output_ids"] for r in trained_records(tmp_path / "local" / "arith_grpo")}
    assert ray_records == local_records  # the same samples
    assert _losses(tmp_path / "ray" / "arith_grpo") == pytest.approx(_losses(tmp_path / "local" / "arith_grpo"),
                                                                    rel=1e-4)
