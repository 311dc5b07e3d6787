"""Faults survived on Ray (issue 13): the trainer's actor killed (``ray.kill``, or its process
killed) and restarted from the last checkpoint, a generation actor killed beside it, a
``--resume`` on ``scheduler.type=ray``; and the shared restart bookkeeping
(``runtime.restarts``) and Ray's death causes, without Ray.

The runs use the parity graph of ``test_resume`` (6 steps x 2 groups x 4 samples, a
checkpoint every 2 steps) on one raylet on 127.0.0.1 with 2 CPUs and three ``gpu_slot``
stand-in devices (generation on one, the trainer on another, or on two for ``train:d2``); see ``test_ray_scheduler``
for why the Ray tests keep Ray on loopback. Every wait is bounded.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime.checkpoint import latest_checkpoint
from test_ray_scheduler import loopback_ray  # noqa: F401 (a fixture)
from test_resume import B, N, PARITY_GRAPH, STEPS, _event_steps, _exactly_once, _same, _weights

REPO = Path(__file__).resolve().parents[1]


# --- without Ray: the shared bookkeeping ------------------------------------------------------

class _Setup:
    """The parts of ``RunSetup`` that ``Restarts`` reads: plan.run, topology's B, the folder."""

    def __init__(self, out_dir: Path, max_restarts: int, batch_groups: int = 2) -> None:
        self.plan = SimpleNamespace(run={"scheduler": {"max_restarts": max_restarts}})
        self.topo = SimpleNamespace(batch_groups=batch_groups, steps=6)
        self.out_dir, self.checkpoint = out_dir, None


def test_restarts_share_one_budget_and_count_the_replayed_groups(tmp_path, capsys):
    from runtime.checkpoint import write_checkpoint
    from runtime.restarts import Restarts, StageDied, WorkerFailed

    setup = _Setup(tmp_path, max_restarts=2)
    restarts = Restarts.for_run(setup)
    restarts.replica("generate/0", "killed by `ray.kill`", 3, how="Ray restarts it")
    assert capsys.readouterr().err == ("areal-flow: generate/0 died (killed by `ray.kill`); Ray restarts it at policy "
                                       "version 3 (1/2)\n")
    write_checkpoint(tmp_path / "checkpoints", 2, lambda folder: None, {"version": 2}, next_index=4)
    # B = 2: version_2's first index is 2 * 2 = 4; 7 groups admitted (0..6), so 4, 5, 6 are admitted again
    restarts.from_checkpoint(setup, StageDied("train_step/0", "exit code -9", admitted=7))
    assert setup.checkpoint.version == 2 and restarts.replayed == 3
    assert capsys.readouterr().err == (
        "areal-flow: train_step/0 died (exit code -9); restarting every worker from version_2 at step 2 (2/2 "
        "restarts): groups 4..6 admitted after it are admitted again under their indices, trajectories and events "
        "of steps >= 2 are rewound\n")
    with pytest.raises(WorkerFailed, match=r"^worker train_step/0 died \(exit code -9\); restarts so far 2, "
                                           r"scheduler.max_restarts=2$"):
        restarts.from_checkpoint(setup, StageDied("train_step/0", "exit code -9", admitted=9))
    assert restarts.block({"train_step/0": {"duplicates": 1}, "generate/0": {}}) == {
        "resumed_from_version": None, "trainer_restarts": 1, "replica_restarts": 1, "replayed_groups": 3,
        "dropped_duplicates": 1,
        "causes": ["generate/0 died (killed by `ray.kill`)", "train_step/0 died (exit code -9)"]}  # the refused third: none


def test_a_death_before_any_checkpoint_restarts_from_version_0(tmp_path, capsys):
    from runtime.restarts import Restarts, StageDied

    setup = _Setup(tmp_path, max_restarts=1)
    restarts = Restarts.for_run(setup)
    restarts.from_checkpoint(setup, StageDied("train_step/0", "exit code -9", admitted=3))
    assert setup.checkpoint is None and restarts.replayed == 3  # groups 0, 1, 2
    assert "restarting every worker from version 0 (no checkpoint yet) at step 0 (1/1 restarts): groups 0..2" \
        in capsys.readouterr().err


def test_the_death_cause_is_the_few_words_of_rays_message():
    pytest.importorskip("ray")
    from ray.exceptions import ActorUnavailableError, RayActorError

    from runtime.ray_exits import exit_cause

    head = "The actor died unexpectedly before finishing this task.\n\tclass_name: WorkerActor\n\tpid: 12798\n"
    killed = RayActorError(error_msg=head + "The actor is dead because its worker process has died. Worker exit type: "
                           "INTENDED_SYSTEM_EXIT Worker exit detail: Worker exits because the actor is killed. The "
                           "actor is dead because it was killed by `ray.kill`.")  # Ray 2.60's words after ray.kill
    assert exit_cause(killed) == "killed by `ray.kill`"
    crashed = RayActorError(error_msg=head + "The actor is dead because its worker process has died. Worker exit "
                            "type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error "
                            "code 2. End of file. Some common causes include: (1) the process was killed by the OOM")
    assert exit_cause(crashed) == ("worker process died (SYSTEM_ERROR: Worker unexpectedly exits with a connection "
                                   "error code 2. End of file)")
    # Ray 2.60's words for a restartable actor (max_restarts > 0) whose process died
    gone = ActorUnavailableError("The actor is temporarily unavailable: RpcError: RPC error: Socket closed "
                                 "rpc_code: 14", None)
    assert exit_cause(gone) == "unreachable: RpcError: RPC error: Socket closed rpc_code: 14"


def test_an_actor_dead_while_starting_with_a_node_not_yet_marked_dead_is_a_lost_host(monkeypatch):
    """Issue 26's chaos bench: a worker node SIGKILLed at step 73; the trainer's death was seen
    (socket closed) before the GCS marked the node dead, so the next attempt's actors were
    placed on it and Ray failed them ("The actor died because its node has died ... never
    ran"); that error stopped the run. A node found dead within ``NODE_DEAD_S`` of such an
    error now makes it ``HostLost`` (the actors start again on a spare node); with every node
    alive the actor's error stands."""
    pytest.importorskip("ray")
    from ray.exceptions import RayActorError

    import runtime.ray_scheduler as rs
    from runtime.restarts import HostLost

    def dead_actor(refs):
        raise RayActorError(error_msg="The actor died because its node has died.")

    scheduler = object.__new__(rs.RayScheduler)
    scheduler.nodes = ["head", "n1"]
    monkeypatch.setattr(rs.ray, "wait", lambda refs, **_: (list(refs), []))
    monkeypatch.setattr(rs.ray, "get", dead_actor)
    monkeypatch.setattr(rs, "POLL_S", 0.0)
    checks = iter([{}, {}, {1: "n1@127.0.0.1"}])  # the GCS marks plan machine n1's node dead on the third look
    monkeypatch.setattr(rs, "lost_machines", lambda nodes: next(checks))
    with pytest.raises(HostLost, match="node n1@127.0.0.1 was lost"):
        scheduler._get(["ref"])
    monkeypatch.setattr(rs, "lost_machines", lambda nodes: {})
    monkeypatch.setattr(rs, "NODE_DEAD_S", 0.05)
    with pytest.raises(RayActorError):  # every node alive: the actor itself died
        scheduler._get(["ref"])

    def init_failed(refs):
        raise RayActorError(error_msg="The actor died because of an error raised in its creation task",
                            actor_init_failed=True)

    def no_look(nodes):
        raise AssertionError("an actor whose __init__ raised waits for no node")

    monkeypatch.setattr(rs.ray, "get", init_failed)
    monkeypatch.setattr(rs, "lost_machines", no_look)
    monkeypatch.setattr(rs, "NODE_DEAD_S", 60.0)
    with pytest.raises(RayActorError, match="creation task"):  # raised at once, its own error
        scheduler._get(["ref"])


def test_an_actor_killed_while_the_actors_start_is_a_restart_not_the_runs_end():
    """Issue 26's chaos bench (three nodes, k = 0): the trainer's rank host killed with ``ray.kill``
    31.6 s in, while the attempt's actors started: the driver's first call to them raised Ray's
    ``ActorDiedError`` and the run ended with Ray's traceback. Now the attempt's actors are
    stopped and the dead actor is named in a ``StageDied``, which the driver turns into a restart
    of every worker from the last checkpoint, counted against ``scheduler.max_restarts``. An
    actor whose ``__init__`` raised still ends the run with its own error."""
    pytest.importorskip("ray")
    from ray.exceptions import RayActorError

    import runtime.ray_scheduler as rs
    from runtime.restarts import StageDied

    class Handle:
        def __init__(self, hex_id: str) -> None:
            self._actor_id = SimpleNamespace(hex=lambda: hex_id)

    scheduler = object.__new__(rs.RayScheduler)
    scheduler.setup = SimpleNamespace(topo=SimpleNamespace(generation=None, groups={}))
    scheduler.sink = object()  # the metrics queue, started by an earlier attempt
    scheduler.actors = {"run/generate/0": Handle("aa01"), "run/train_step/0@n1": Handle("bb02")}
    stopped: list[bool] = []
    scheduler.stop = lambda wait: stopped.append(wait)
    scheduler._replace_lost_nodes = scheduler._start_actors = lambda: None
    words = ("The actor died unexpectedly before finishing this task.\n\tclass_name: WorkerActor\n"
             "\tname: run/train_step/0@n1\nThe actor is dead because it was killed by `ray.kill`.")  # Ray 2.60's

    def killed():
        raise RayActorError(actor_id="bb02", error_msg=words)

    scheduler._bind_host = killed
    with pytest.raises(StageDied) as died:
        scheduler.addresses()
    assert str(died.value) == "run/train_step/0@n1 died (killed by `ray.kill`, while the actors started)"
    assert died.value.admitted == 0 and stopped == [True]

    def init_failed():
        raise RayActorError(actor_id="bb02", error_msg="error raised in its creation task", actor_init_failed=True)

    scheduler._bind_host = init_failed
    with pytest.raises(RayActorError, match="creation task"):
        scheduler.addresses()
    assert stopped == [True]  # nothing more stopped: the error ends the run


def test_a_rank_ended_by_a_signal_on_a_rank_host_is_the_trainers_death(monkeypatch):
    """Issue 26's chaos bench (k = 2, three nodes): rank 1, on the rank host, was ended by
    SIGABRT; the host raised ``RankKilled`` before its own SIGABRT (``runtime.trainer_ranks``)
    ended it, the driver could not unpickle that exception (its two arguments) and ended with
    Ray's ``UnserializableException``. ``RankKilled`` now pickles whole, and a rank host's
    ``RankKilled`` is the trainer's death (every worker restarts); another error stays one."""
    pytest.importorskip("ray")
    import pickle

    from ray.exceptions import RayTaskError

    import runtime.ray_ranks as rr
    from runtime.driver import DIED, WorkerEnd
    from runtime.parallel.launch import RankKilled

    back = pickle.loads(pickle.dumps(RankKilled(1, 6)))
    assert (back.rank, back.signal, str(back)) == (1, 6, "rank 1 was ended by signal 6 (exit code -6)")
    raised = {}

    def get(ref):
        raise RayTaskError("WorkerActor.run_ranks", "Traceback ...", raised["cause"]).as_instanceof_cause()

    monkeypatch.setattr(rr.ray, "get", get)
    hosts = rr.RankHosts(lambda exc: "?")
    raised["cause"] = RankKilled(1, 6)
    hosts.started("ref", "train_step/0@n1", "train_step/0")
    assert hosts.end("ref") == WorkerEnd("train_step/0", DIED, "its ranks on train_step/0@n1 died: rank 1 was ended "
                                         "by signal 6 (exit code -6)")
    raised["cause"] = ValueError("a rank raised")
    hosts.started("ref", "train_step/0@n1", "train_step/0")
    assert hosts.end("ref") is None  # an error: kept for lead_error, under the host's name
    assert [e.split("\n")[0] for e in hosts.errors["train_step/0"]] == ["train_step/0@n1:"]


# --- on Ray -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_slots(loopback_ray):  # noqa: F811 (the imported fixture)
    """One raylet on 127.0.0.1 with 2 CPUs and three ``gpu_slot`` stand-in devices (a dp2 trainer needs them)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"gpu_slot": 3},
                                                            "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    yield cluster
    cluster.shutdown()


def _run(tmp_path: Path, cluster, name: str, *overrides: str, kill=None, graph: str = PARITY_GRAPH) -> dict:
    """The parity graph (or ``graph``) on ``cluster``; ``kill(out_dir)`` runs in a thread beside it."""
    from areal_flow.cli import load_flow
    from areal_flow.config_load import load_config
    from areal_flow.cli.run import run_experiment

    (tmp_path / "graph.py").write_text(graph)
    fl = load_flow(tmp_path / "graph.py")
    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [
        f"train.steps={STEPS}", f"train.batch_size={B}", f"gen.n_samples={N}", "warm_start.steps=10",
        "eval.enabled=false", "train.checkpoint_every=2", "train.lr=1e-2", "scheduler.type=ray",
        "scheduler.node_ip=127.0.0.1", "scheduler.device_resource=gpu_slot", "cluster.n_gpus_per_node=2",
        f"scheduler.address={cluster.address}", f"out_dir={tmp_path}", f"name={name}", *overrides])
    thread = None
    if kill is not None:
        thread = threading.Thread(target=kill, args=(tmp_path / name,), daemon=True)
        thread.start()
    try:
        return run_experiment(fl(cfg), cfg, show_progress=False)
    finally:
        if thread is not None:
            thread.join(timeout=30)


def _after_step(out: Path, step: int, timeout_s: float = 300) -> None:
    """Wait until ``step`` is trained (its trajectories written) and a checkpoint is complete."""
    deadline, path = time.monotonic() + timeout_s, out / "trajectories" / "trajectories.jsonl"
    while time.monotonic() < deadline:
        lines = len(path.read_text().splitlines()) if path.is_file() else 0
        if lines >= (step + 1) * B * N and latest_checkpoint(out) is not None:
            return
        time.sleep(0.02)
    raise TimeoutError(f"step {step} not trained within {timeout_s} s")


def _ray_kill(name: str):
    def kill(out: Path) -> None:
        import ray

        from runtime.ray_scheduler import NAMESPACE

        _after_step(out, 2)
        ray.kill(ray.get_actor(f"{out.name}/{name}", namespace=NAMESPACE), no_restart=False)
        kill.done = True

    kill.done = False
    return kill


def _kill_trainer_process(out: Path) -> None:
    """SIGKILL the process of the trainer's actor: the one holding the run's trajectories file open."""
    import psutil

    _after_step(out, 2)
    path = str(out / "trajectories" / "trajectories.jsonl")
    for proc in psutil.Process().children(recursive=True):
        try:
            if any(f.path == path for f in proc.open_files()):
                proc.kill()
                return
        except psutil.Error:
            continue


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, two_slots) -> Path:
    """The k = 0 run on Ray the interrupted ones must reproduce bit for bit."""
    tmp = tmp_path_factory.mktemp("ray_whole")
    _run(tmp, two_slots, "whole", "async.max_staleness=0")
    return tmp / "whole"


@pytest.mark.slow
def test_a_killed_trainer_actor_is_restarted_from_its_checkpoint_bit_for_bit(tmp_path, two_slots, uninterrupted,
                                                                            warm_cache, capsys):
    whole = _weights(uninterrupted / "model")
    assert not _same(whole, _weights(uninterrupted / "checkpoints/version_2"))  # the steps after it trained
    kill = _ray_kill("train_step/0")
    summary = _run(tmp_path, two_slots, "dies", "async.max_staleness=0", "scheduler.max_restarts=1", kill=kill)
    assert kill.done
    line = next(x for x in capsys.readouterr().err.splitlines() if "restarting every worker" in x)
    assert line.startswith("areal-flow: train_step/0 died (killed by `ray.kill`); restarting every worker from "
                           "version_"), line
    assert _same(_weights(tmp_path / "dies/model"), whole)
    _exactly_once(tmp_path / "dies", k=0)
    assert _event_steps(tmp_path / "dies") == list(range(STEPS))  # events continue, each step once
    restarts = summary["restarts"]
    assert restarts["trainer_restarts"] == 1 and restarts["replica_restarts"] == 0
    assert restarts["resumed_from_version"] is None and restarts["dropped_duplicates"] == 0
    assert summary["samples_trained"] == STEPS * B * N
    assert Path(summary["ray"]["last_checkpoint"]) == tmp_path / f"dies/checkpoints/version_{STEPS}"


@pytest.mark.slow
def test_a_ray_run_whose_trainer_process_died_resumes_bit_for_bit(tmp_path, two_slots, uninterrupted, warm_cache,
                                                                   capsys):
    from runtime.restarts import WorkerFailed

    with pytest.raises(WorkerFailed, match=r"worker train_step/0 died \(worker process died .*\); restarts so far 0, "
                                           r"scheduler.max_restarts=0"):
        _run(tmp_path, two_slots, "cut", "async.max_staleness=0", "scheduler.max_restarts=0",
             kill=_kill_trainer_process)
    cut = latest_checkpoint(tmp_path / "cut")
    assert cut is not None and cut.version < STEPS and not (tmp_path / "cut/model").exists()
    summary = _run(tmp_path, two_slots, "cut", "async.max_staleness=0", f"resume={tmp_path / 'cut'}")
    assert f"resuming {tmp_path / 'cut'} from version_{cut.version} (step {cut.version} of {STEPS})" \
        in capsys.readouterr().err
    assert _same(_weights(tmp_path / "cut/model"), _weights(uninterrupted / "model"))
    _exactly_once(tmp_path / "cut", k=0)
    assert _event_steps(tmp_path / "cut") == list(range(STEPS))
    assert summary["restarts"]["resumed_from_version"] == cut.version and summary["samples_trained"] == STEPS * B * N
    kept = (tmp_path / "cut/summary.json").read_bytes()
    again = _run(tmp_path, two_slots, "cut", "async.max_staleness=0", f"resume={tmp_path / 'cut'}")
    assert again == json.loads(kept)  # complete: runs nothing, writes nothing
    assert f"is complete: version_{STEPS} holds all {STEPS} steps" in capsys.readouterr().err


@pytest.mark.slow
def test_async_run_survives_a_dead_generation_actor_and_a_dead_trainer(tmp_path, two_slots, warm_cache):
    def kill_both(out: Path) -> None:
        import ray

        from runtime.ray_scheduler import NAMESPACE

        trajectories = out / "trajectories" / "trajectories.jsonl"
        deadline = time.monotonic() + 300
        while not trajectories.is_file() and time.monotonic() < deadline:  # the trainer is up, no step trained yet
            time.sleep(0.02)
        ray.kill(ray.get_actor(f"{out.name}/generate/0", namespace=NAMESPACE), no_restart=False)
        # Step 3 trains groups 6 and 7, admitted at version >= 2 (k = 1, B = 2: (1 + v + 1) * 2 > 6), which the
        # killed replica never held: once it is trained, the driver has restarted the replica.
        _after_step(out, 3)
        _kill_trainer_process(out)

    summary = _run(tmp_path, two_slots, "async", "async.max_staleness=1", "scheduler.max_restarts=2", kill=kill_both)
    trained = _exactly_once(tmp_path / "async", k=1)  # every sample id once, staleness <= 1
    assert {r["staleness"] for r in trained} <= {0, 1}
    restarts = summary["restarts"]
    assert restarts["replica_restarts"] == 1 and restarts["trainer_restarts"] == 1
    assert summary["samples_trained"] == STEPS * B * N and (tmp_path / "async/model/model.safetensors").is_file()


@pytest.mark.slow
def test_kills_mid_weight_update_keep_a_ray_run_bit_for_bit(tmp_path, two_slots, uninterrupted, warm_cache, capsys):
    """The replica killed holding version 2 not yet loaded; the trainer killed having sent version 4 before it
    recorded step 3 (so the last checkpoint, version_2, is behind what the replica may hold)."""
    summary = _run(tmp_path, two_slots, "mid", "async.max_staleness=0", "scheduler.max_restarts=2",
                   "debug.kill_at=[generate/0:weights_received:2, train_step/0:weights_published:4]")
    assert sorted(p.name for p in (tmp_path / "mid/faults").iterdir()) == [
        "generate-0-weights_received-2", "train_step-0-weights_published-4"]  # both points fired
    err = capsys.readouterr().err
    assert "areal-flow: generate/0 died (unreachable: " in err and "Ray restarts it at policy version 1 (1/2)" in err
    assert "areal-flow: train_step/0 died (worker process died" in err
    assert "restarting every worker from version_2 at step 2 (2/2 restarts)" in err
    assert _same(_weights(tmp_path / "mid/model"), _weights(uninterrupted / "model"))
    _exactly_once(tmp_path / "mid", k=0)
    assert _event_steps(tmp_path / "mid") == list(range(STEPS))
    assert summary["restarts"]["replica_restarts"] == 1 and summary["restarts"]["trainer_restarts"] == 1


@pytest.mark.slow
def test_a_dp2_trainer_killed_on_ray_is_restarted_from_its_sharded_checkpoint(tmp_path, two_slots, warm_cache,
                                                                             capsys):
    """Rank 0 of a train:d2 trainer (a child process of its actor) killed after sending version 4: the actor
    ends by the same signal and every actor restarts from version_2 (trainer_dcp/), bit for bit."""
    wide = ("async.max_staleness=0", "cluster.n_gpus_per_node=3", "compile.allocation=train:d2 + gen:d1")
    _run(tmp_path, two_slots, "whole", *wide)
    summary = _run(tmp_path, two_slots, "dies", *wide, "scheduler.max_restarts=1",
                   "debug.kill_at=[train_step/0:weights_published:4]")
    assert "restarting every worker from version_2 at step 2 (1/1 restarts)" in capsys.readouterr().err
    assert (tmp_path / "dies/checkpoints/version_2/trainer_dcp/.metadata").is_file()
    assert _same(_weights(tmp_path / "dies/model"), _weights(tmp_path / "whole/model"))
    _exactly_once(tmp_path / "dies", k=0)
    assert summary["restarts"]["trainer_restarts"] == 1 and summary["workers"]["train_step/0"]["world_size"] == 2


BUGGY_ESTIMATOR_GRAPH = PARITY_GRAPH.replace("from areal_flow import Model, flow, ops", """\
from areal_flow import Model, flow, ops
from areal_flow.algorithms.catalog import register_estimator


@register_estimator("buggy")
def buggy(rewards, group_ids, loss_mask):
    return len(rewards.shape[0])  # the bug: an int has no len()
""").replace('estimator="grpo"', 'estimator="buggy"')


@pytest.mark.slow
def test_a_bug_in_a_ray_worker_stops_the_run_with_its_traceback(tmp_path, two_slots):
    """Issue 26: no broad ``except`` on the Ray path turns a worker's bug into a death, a
    restart or a hang: the trainer's estimator raises, and the run fails at once with the
    worker's traceback down to the faulty line."""
    from runtime.restarts import WorkerFailed

    assert "estimator=\"buggy\"" in BUGGY_ESTIMATOR_GRAPH
    with pytest.raises(WorkerFailed) as info:
        _run(tmp_path, two_slots, "buggy", "compile.allocation=gen:d1 + train:d1", graph=BUGGY_ESTIMATOR_GRAPH)
    message = str(info.value)
    assert message.startswith("train_step/0 failed:\n") and "ray::WorkerActor.run()" in message  # Ray's header
    assert 'graph.py", line 8, in buggy\n    return len(rewards.shape[0])' in message  # the worker's frames
    assert "TypeError: object of type 'int' has no len()" in message
    assert not (tmp_path / "buggy" / "model").exists()
