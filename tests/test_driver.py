"""One driver for local and Ray (``runtime.driver``): the trainer rule, the attempt loop, restarts,
metrics and the stop are written once; a scheduler only hosts workers.

The plan here has several stage groups with batch nodes (PPO with the critic's train_step on
its own mesh: ``critic_step`` = advantage + the critic's train_step, then ``train_step`` = the
policy's, a chain: ``compiler.hosting``), two generation replicas, and no process is started:
a scripted scheduler reports the workers' ends.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from areal_flow.config_load import load_config
from runtime.driver import DIED, ERROR, OK, Driver, Scheduler, WorkerEnd
from runtime.restarts import HostLost, WorkerFailed
from runtime.run_setup import RunSetup
from runtime.topology import build_topology

REPO = Path(__file__).resolve().parents[1]
TINY = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false"]
SEVERAL = ["cluster.n_gpus_per_node=4", "compile.allocation=critic_step:d1 + train:d1 + gen:d2",
           "scheduler.max_restarts=2"]


def _plan(tmp_path):
    from areal_flow.cli import load_flow
    from compiler.program import compile_program

    cfg = load_config(REPO / "graphs/arith_ppo.yaml", [*TINY, *SEVERAL, f"out_dir={tmp_path}", "name=several"])
    return compile_program(load_flow(REPO / "graphs/arith_ppo.py")(cfg), cfg)


def test_the_trainer_is_the_group_that_trains_the_generators_model(tmp_path):
    topo = build_topology(_plan(tmp_path))
    with_batch = [g.name for g in topo.groups.values() if g.batch_nodes]
    assert with_batch == ["critic_step", "train_step"]  # the chain: advantage sits with critic_step (its model)
    assert topo.trainer.name == "train_step"  # it holds train_step, which trains 'policy', the generator's model


class _Router:
    """The router's face the driver uses; replica 1 holds version 5 when it dies."""

    def __init__(self):
        self.dispatched, self.resampled, self.redispatched, self.rejected = 12, 0, 0, 0
        self.admission = SimpleNamespace(accepted=4, running=2)
        self.versions = {0: 5, 1: 5}
        self.replaced = []

    def run(self, stop):
        stop.wait()

    def replace_replica(self, rank, inbox):
        self.replaced.append((rank, inbox))


class _Logger:
    def __init__(self):
        self.steps, self.last_step = [], None

    def log_step(self, metrics):
        self.steps.append(metrics)
        self.last_step = metrics["step"]

    def note(self, text):
        pass

    def close(self):
        pass


class _Setup(RunSetup):
    """The real specs; a scripted router, logger and summary."""

    def router(self, replicas, control):
        self.routers.append(_Router())
        return self.routers[-1]

    def logger(self, rewind=False):
        self.loggers.append(_Logger())
        return self.loggers[-1]

    def merge_trace(self):
        pass

    def finish(self, logger, workers, **extra):
        return {"workers": workers, **extra}


class _Scripted:
    """A scheduler whose workers end as ``script`` says: one list of ends per ``wait`` call."""

    restart_how, start_how = "restarting it", "starting {n} workers"

    def __init__(self, script, metrics=()):
        self.script, self.pending_metrics = list(script), list(metrics)
        self.started, self.stops, self.revived, self.attempts = [], [], [], 0

    def addresses(self):
        self.attempts += 1
        groups = {"generate": 2, "train_step": 1, "critic_step": 1}
        addresses = {g: [f"ipc://a{self.attempts}/{g}-{r}" for r in range(n)] for g, n in groups.items()}
        addresses["weights"] = [f"ipc://a{self.attempts}/weights-{r}" for r in range(2)]
        return addresses, f"ipc://a{self.attempts}/control", 1

    def start(self, spec, group):
        self.started.append(spec)

    def wait(self, timeout_s):
        return self.script.pop(0) if self.script else []

    def metrics(self):
        out, self.pending_metrics = self.pending_metrics, []
        return out

    def revive(self, name, cause):
        self.revived.append((name, cause))

    def stop(self, wait):
        self.stops.append(wait)

    def release(self):
        return {"released": True}


def _setup(tmp_path) -> _Setup:
    plan = _plan(tmp_path)
    setup = _Setup(plan, build_topology(plan), tmp_path / "several", show_progress=False)
    setup.routers, setup.loggers = [], []
    return setup


def test_the_run_ends_with_the_trainer_and_a_dead_replica_restarts_at_its_version(tmp_path):
    setup = _setup(tmp_path)
    scheduler = _Scripted([[WorkerEnd("critic_step/0", OK, {"steps": 3})],  # a batch group, but not the trainer
                           [WorkerEnd("generate/1", DIED, "exit code -9")],
                           [],
                           [WorkerEnd("train_step/0", OK, {"steps": 3})],
                           [WorkerEnd("generate/0", OK, {"groups": 3})], [WorkerEnd("generate/1", OK, {"groups": 3})]],
                          metrics=[{"step": 0}])
    assert isinstance(scheduler, Scheduler)
    summary = Driver(setup, scheduler).execute()
    assert set(summary["workers"]) == {"critic_step/0", "train_step/0", "generate/0", "generate/1", "router"}
    assert summary["released"] and summary["restarts"]["replica_restarts"] == 1
    assert setup.loggers[0].steps == [{"step": 0}]
    # the restarted replica: same inbox, waits for the router's version 5 from the trainer's inbox
    first = {f"{s.group}/{s.rank}": s for s in scheduler.started[:4]}
    again = scheduler.started[4]
    assert (again.group, again.rank, again.inbox) == ("generate", 1, "ipc://a1/generate-1")
    assert (again.resume_version, again.resync) == (5, "ipc://a1/train_step-0")
    assert setup.routers[0].replaced == [(1, "ipc://a1/generate-1")]
    assert scheduler.revived == [("generate/1", "exit code -9")]
    assert first["generate/0"].resync == "" and first["train_step/0"].routes == {
        "train_step": ["ipc://a1/weights-0", "ipc://a1/weights-1"]}
    assert scheduler.stops == [False]  # every worker ended once the run is done


def test_a_dead_stage_worker_restarts_every_worker_and_an_error_stops_the_run(tmp_path):
    setup = _setup(tmp_path)
    scheduler = _Scripted([[WorkerEnd("critic_step/0", DIED, "exit code -9")],  # attempt 1: a stage worker dies
                           [WorkerEnd("generate/0", ERROR, "ValueError: bad prompt")]])  # attempt 2
    with pytest.raises(WorkerFailed, match=r"^generate/0 failed: ValueError: bad prompt$"):
        Driver(setup, scheduler).execute()
    assert scheduler.attempts == 2  # every worker again, from version 0 (no checkpoint)
    assert [s.resume_version for s in scheduler.started[4:]] == [0] * 4
    assert scheduler.stops == [True, False, False]  # gone before attempt 2 starts; ended after each


def test_both_schedulers_are_schedulers_of_the_one_driver(tmp_path):
    from test_interfaces import _check

    from runtime.launch import LocalScheduler
    from runtime.ray_scheduler import RayScheduler, _settings

    setup = _setup(tmp_path)
    for scheduler in (LocalScheduler(setup), RayScheduler(setup, _settings(setup.plan))):
        assert isinstance(scheduler, Scheduler)
        _check(type(scheduler), Scheduler)  # same methods, same parameters


class _HostGone(_Scripted):
    """A scheduler whose dead replica's host is gone (a lost node): it cannot be revived."""

    def revive(self, name, cause):
        super().revive(name, cause)
        raise HostLost("its node 5fe56b49@10.0.0.2 (plan machine n1) was lost")


def test_a_replica_whose_host_is_lost_restarts_every_worker_from_the_checkpoint(tmp_path, capsys):
    setup = _setup(tmp_path)
    scheduler = _HostGone([[WorkerEnd("generate/1", DIED, "unreachable: IOError")],  # attempt 1
                           [WorkerEnd("critic_step/0", OK, {"steps": 3})], [WorkerEnd("train_step/0", OK, {"steps": 3})],
                           [WorkerEnd("generate/0", OK, {})], [WorkerEnd("generate/1", OK, {})]])  # attempt 2
    summary = Driver(setup, scheduler).execute()
    assert scheduler.attempts == 2 and scheduler.stops == [True, False, False]
    assert [s.resume_version for s in scheduler.started[4:]] == [0] * 4  # every worker, from version 0
    assert summary["restarts"]["trainer_restarts"] == 1 and summary["restarts"]["replica_restarts"] == 0
    assert ("areal-flow: generate/1 died (unreachable: IOError; its node 5fe56b49@10.0.0.2 (plan machine n1) was "
            "lost); restarting every worker from version 0") in capsys.readouterr().err


def test_on_ray_replicas_and_a_trainers_ranks_run_on_their_machines_and_a_one_actor_group_may_not_span(tmp_path):
    """Issue 26: `gen:d2` on two one-device machines is one replica per machine (bundle 0 on
    n0, bundle 1 on n1), each holding its device; a two-rank trainer on `n1-2` is one actor
    per machine (issue 24: rank 0's stage worker, a rank host); a forward-only reference model
    on `n2-3` (a plan compiled for the local scheduler) is one actor and is refused before any
    actor starts, by compiler.hosting's rule."""
    from areal_flow.cli import load_flow
    from compiler.program import compile_program
    from runtime.ray_cluster import ClusterMismatchError
    from runtime.ray_scheduler import RayScheduler, _settings

    def scheduler(allocation, graph="arith_grpo", machines=3):
        cfg = load_config(REPO / f"graphs/{graph}.yaml", [*TINY, f"cluster.n_nodes={machines}",
                                                          "cluster.n_gpus_per_node=1", f"compile.allocation={allocation}",
                                                          f"out_dir={tmp_path}"])
        plan = compile_program(load_flow(REPO / f"graphs/{graph}.py")(cfg), cfg)
        return RayScheduler(_Setup(plan, build_topology(plan), tmp_path / "x", show_progress=False), _settings(plan))

    layout = {name: (mesh.label(), bundle, share) for name, (mesh, bundle, share) in
              scheduler("gen:d2 + train:d1").layout().items()}
    assert layout == {"generate/0": ("n0-1", 0, 1), "generate/1": ("n0-1", 1, 1),
                      "train_step/0": ("n2:g0", 0, 1)}
    layout = {name: (mesh.label(), bundle, share) for name, (mesh, bundle, share) in
              scheduler("gen:d1 + train:d2").layout().items()}
    assert layout == {"generate/0": ("n0:g0", 0, 1), "train_step/0": ("n1-2", 0, 1),
                      "train_step/0@n1": ("n1-2", 1, 1)}
    with pytest.raises(ClusterMismatchError, match=r"^node 'logprobs': ray-one-machine: its mesh n2-3 spans 2 "
                                                   r"machines but runs as 1 actor\(s\) on Ray; a worker's processes"):
        scheduler("gen:d1 + train:d1 + logprobs:d2 + reward:d1", "arith_grpo_ref_rm", 5).layout()
