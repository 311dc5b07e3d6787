"""The hybrid worker (``runtime.hybrid``): a generation replica and the trainer time-sharing one
mesh run in ONE local process, their weights handed over in memory
(``runtime.weights_in_process``); the same k = 0 run as two processes, bit for bit; a kill of
the process restarts every worker from the checkpoint, an error in the replica's thread stops
the run naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from areal_flow import Model, flow, ops
from areal_flow.ops import register_op

from test_resume import _cli, _exactly_once, _finish, _same, _weights

REPO = Path(__file__).resolve().parents[1]
SHARED = ["async.max_staleness=0", "cluster.n_gpus_per_node=1", "compile.allocation=gen:d1 | train:d1",
          "scheduler.hybrid=true"]


def _topology(*overrides: str):
    from areal_flow.cli import load_flow
    from areal_flow.config_load import load_config
    from compiler.program import compile_program
    from runtime.topology import build_topology

    cfg = load_config(REPO / "graphs/arith_grpo.yaml", ["warm_start.steps=10", "eval.enabled=false", *overrides])
    return build_topology(compile_program(load_flow(REPO / "graphs/arith_grpo.py")(cfg), cfg))


def test_only_one_replica_and_a_one_rank_trainer_on_one_mesh_share_a_process():
    from runtime.hybrid import hybrid_pair, why_not_hybrid

    gen, trainer = hybrid_pair(_topology("cluster.n_gpus_per_node=1", "compile.allocation=gen:d1 | train:d1"))
    assert (gen.name, trainer.name) == ("generate", "train_step")
    assert hybrid_pair(_topology("compile.allocation=gen:d1 + train:d1")) is None  # two meshes
    assert hybrid_pair(_topology("compile.allocation=gen:d2 | train:d2")) is None  # two replicas, a 2-rank trainer
    # why not, as the run says it when scheduler.hybrid=true cannot be kept (runtime.launch.run)
    assert why_not_hybrid(_topology("compile.allocation=gen:d1 + train:d1")).startswith(
        "the allocation gives generation a mesh of its own")
    assert why_not_hybrid(_topology("compile.allocation=gen:d2 | train:d2")) == \
        "it holds several generation replicas or trainer ranks"


def test_in_process_weights_keep_versions_and_the_tensor_set():
    from runtime.weight_set import TensorSetError
    from runtime.weights import WeightPublisher
    from runtime.weights_in_process import InProcessPublisher, InProcessSubscriber, open_publisher, open_subscriber

    sub = open_subscriber("mem://test/weights-0", secret=b"k")
    assert isinstance(sub, InProcessSubscriber) and sub.poll() is None
    shared = open_publisher(["mem://test/weights-0"], secret=b"k", snapshot=False)
    assert isinstance(shared, InProcessPublisher)
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    shared.publish({"w": w}, 1)
    version, state = sub.poll()
    assert version == 1 and state["w"] is not w and state["w"].data_ptr() == w.data_ptr()  # no copy (k = 0)
    assert shared.published_bytes == 6 * 4
    with pytest.raises(ValueError, match="versions must increase: got 1 after 1"):
        shared.publish({"w": w}, 1)
    shared.publish({"w": w + 1}, 2)
    shared.publish({"w": w + 2}, 3)  # 2 superseded unread
    version, state = sub.poll()
    assert version == 3 and torch.equal(state["w"], w + 2) and sub.dropped_versions == 1
    shared.publish({"v": w}, 4)
    with pytest.raises(TensorSetError, match="version 4 discarded, keeping version 3"):
        sub.poll()
    assert sub.version == 3 and sub.set_errors == 1
    copied = InProcessPublisher(["mem://test/weights-0"], snapshot=True)
    copied.publish({"w": w}, 5)
    w.add_(100)  # the trainer steps after publishing (k >= 1): the version keeps what was published
    assert sub.wait(5, timeout_s=1)[1]["w"][0, 1].item() == 1.0
    half_sub = open_subscriber("mem://test/weights-1", secret=b"k")
    half = InProcessPublisher(["mem://test/weights-1"], snapshot=True, dtype=torch.bfloat16)
    tied, steps = torch.randn(4, 3), torch.arange(3)
    sent = tied.clone()
    half.publish({"embed_tokens.weight": tied, "w": w + 0.001, "norm": w[0] + 0.001, "lm_head.weight": tied,
                  "steps": steps}, 1)
    steps.add_(5)
    tied.add_(1)  # copied (snapshot) though not cast
    got = half_sub.wait(1, timeout_s=1)[1]
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], (w + 0.001).to(torch.bfloat16))
    assert got["norm"].dtype == torch.float32 and torch.equal(got["norm"], w[0] + 0.001)  # a vector: as it is
    assert torch.equal(got["embed_tokens.weight"], sent) and torch.equal(got["lm_head.weight"], sent)  # tied: fp32
    assert got["steps"].tolist() == [0, 1, 2]
    assert half.published_bytes == 6 * 2 + 3 * 4 + 2 * 12 * 4 + 3 * 8
    for end in (shared, copied, half, sub, half_sub):
        end.close()
    wire = open_publisher("ipc:///tmp/af-hybrid-test", secret=b"k" * 16, linger_s=0)
    assert isinstance(wire, WeightPublisher)
    wire.close()


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hybrid")
    (out / "one.stderr").write_text(_finish(_cli(out, "one", *SHARED)))
    return out / "one"


def test_one_process_trains_what_two_processes_do_bit_for_bit(hybrid_run, tmp_path, warm_cache):
    two_err = _finish(_cli(tmp_path, "two", *SHARED, "scheduler.hybrid=false"))
    one_err = (hybrid_run.parent / "one.stderr").read_text()  # the start line says what runs (the bar's note)
    assert "hybrid: generation and training time-share one process; starting the workers" in one_err
    assert "starting 2 workers" not in one_err and "time-share one process" not in two_err
    assert "starting 2 workers (torch, models)" in two_err
    one = json.loads((hybrid_run / "summary.json").read_text())["workers"]
    two = json.loads((tmp_path / "two/summary.json").read_text())["workers"]
    assert one["generate/0"]["pid"] == one["train_step/0"]["pid"]  # one worker process
    assert two["generate/0"]["pid"] != two["train_step/0"]["pid"]
    assert one["generate/0"]["placement"] == one["train_step/0"]["placement"] == {"devices": [0]}
    assert one["generate/0"]["weight_updates"] == two["generate/0"]["weight_updates"] == 5  # versions 1..5 of 6 steps
    trained = _exactly_once(hybrid_run, k=0)
    assert trained == _exactly_once(tmp_path / "two", k=0)  # the same samples, tokens, log-probs, rewards
    assert _same(_weights(hybrid_run / "model"), _weights(tmp_path / "two/model"))


@pytest.mark.slow
def test_a_killed_hybrid_process_restarts_from_the_checkpoint_and_ends_bit_for_bit(hybrid_run, tmp_path, warm_cache):
    """The replica's kill point ends the whole process: the driver sees the trainer die and restarts
    every worker from the last checkpoint (train.checkpoint_every=2), as for a dead trainer."""
    err = _finish(_cli(tmp_path, "killed", *SHARED, "scheduler.max_restarts=2",
                       "debug.kill_at=[generate/0:weights_received:3]"))
    assert "areal-flow: train_step/0 died (exit code -9); restarting every worker from version_2" in err
    _exactly_once(tmp_path / "killed", k=0)
    assert _same(_weights(tmp_path / "killed/model"), _weights(hybrid_run / "model"))
    restarts = json.loads((tmp_path / "killed/summary.json").read_text())["restarts"]
    assert restarts["trainer_restarts"] == 1 and restarts["replica_restarts"] == 0


@register_op("broken_bonus", inputs={"rollouts": "rollouts", "rewards": "rewards"}, outputs={"rewards": "rewards"})
def broken_bonus(rollouts, rewards):
    """A user node with a bug, run in the replica's thread of the hybrid process."""
    return [r + t.no_such_field for t, r in zip(rollouts, rewards)]


@flow
def grpo_with_a_bug(cfg):
    policy = Model("policy", cfg.model)
    rollout = ops.generate(policy, ops.dataset(cfg.dataset), n_samples=cfg.gen.n_samples,
                           max_new_tokens=cfg.gen.max_new_tokens)
    adv = ops.advantage(rollout, broken_bonus(rollout, ops.reward(rollout, fn="arithmetic")), estimator="grpo")
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats


def test_an_error_in_the_replica_thread_stops_the_run_naming_it(tmp_path, warm_cache):
    from areal_flow.cli.run import run_experiment
    from areal_flow.config_load import load_config
    from runtime.restarts import WorkerFailed

    cfg = load_config(REPO / "graphs/arith_grpo.yaml", ["train.steps=2", "train.batch_size=2", "gen.n_samples=2",
                                                        "warm_start.steps=10", "eval.enabled=false", *SHARED,
                                                        f"out_dir={tmp_path}", "name=bug"])
    with pytest.raises(WorkerFailed, match="(?s)generate/0 failed:.*no attribute .no_such_field."):
        run_experiment(grpo_with_a_bug(cfg), cfg, show_progress=False)
