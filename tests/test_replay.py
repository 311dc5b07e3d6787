"""Experience replay (issue 24): ``ops.replay`` between ``ops.advantage`` and a ``train_step``.

The buffer's draw (``floor(r N / (1 - r))`` rows, rounded to the trainer's quantum), its
eviction by staleness (``s - start_version > k``), padding and capacity, with counts and
versions chosen by hand; bad knobs refused naming the node or key; the buffer's round trip
through a checkpoint file (issue 26: a restored executor draws the rows the uninterrupted one
draws); one short CLI run in which replayed rows reach the batch within k, the fresh samples
are trained once, and a resume from its checkpoint replays the uninterrupted run's rows.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from areal_flow.batching import collate
from areal_flow.config import ConfigError
from areal_flow.graph import GraphError
from areal_flow.ops.interfaces import Checkpointed
from areal_flow.ops.replay import ReplayBuffer, ReplayExecutor
from areal_flow.types import REPLAYED, Trajectory
from areal_flow.values import Advantages
from runs import REPO, cli_run, records

GRAPH = REPO / "graphs" / "arith_grpo_replay.py"


def _step(index: int, version: int, n: int = 8, length: int = 2) -> Advantages:
    """``n`` fresh rows of group ``index``, every token sampled by ``version``, responses ``length`` long."""
    trajs = [Trajectory(f"{index}:{j}", index, [1, 2], [3] * length, [-0.5] * length, [version] * length, "stop",
                        reward=float(j % 2)) for j in range(n)]
    batch = collate(trajs, pad_id=0)
    batch["advantages"] = batch["loss_mask"] * (index + 1)
    return Advantages(batch, trajs)


@pytest.mark.parametrize("ratio, quantum, drawn", [(0.25, 1, 2), (0.2, 1, 2), (0.5, 1, 8), (0.5, 3, 6), (0.25, 4, 0),
                                                   (0.0, 1, 0)])
def test_the_replayed_rows_are_floor_of_r_n_over_1_minus_r_rounded_to_the_quantum(ratio, quantum, drawn):
    # 8 fresh rows: 0.25 -> floor(8/3) = 2; 0.2 -> floor(2.0) = 2; 0.5 -> 8, to 3s -> 6; 0.25 to 4s -> 0
    buf = ReplayBuffer(ratio, capacity=64, max_staleness=2, quantum=quantum)
    buf.mix(0, _step(0, version=0))
    out = buf.mix(1, _step(1, version=1))
    assert out.batch["input_ids"].shape[0] == len(out.trajectories) == 8 + drawn
    assert out.stats["replay/samples"] == drawn and out.stats["replay/share"] == pytest.approx(drawn / (8 + drawn))
    replayed = out.trajectories[8:]
    assert all(t.meta[REPLAYED] == 0 and t.group_id == 0 for t in replayed)  # from step 0, marked
    assert all(REPLAYED not in t.meta for t in out.trajectories[:8])
    # step 0's advantages: 1 on each of its 2 response tokens
    assert torch.equal(out.batch["advantages"][8:].sum(1), torch.full((drawn,), 2.0))
    assert torch.equal(out.batch["versions"][8:, 2:], torch.zeros(drawn, 2, dtype=torch.long))  # versions kept


def test_rows_older_than_k_versions_are_evicted_never_trained():
    buf = ReplayBuffer(0.5, capacity=64, max_staleness=1)  # k = 1
    assert buf.mix(0, _step(0, version=0)).stats["replay/samples"] == 0  # nothing buffered yet
    one = buf.mix(1, _step(1, version=1))  # step-0 rows: 1 - 0 = 1 <= k
    assert one.stats["replay/samples"] == 8 and {t.group_id for t in one.trajectories[8:]} == {0}
    two = buf.mix(2, _step(2, version=1))  # step-0 rows: 2 - 0 = 2 > k, evicted; step-1 rows: 2 - 1 = 1
    assert two.stats["replay/evicted"] == 8 and {t.group_id for t in two.trajectories[8:]} == {1}
    assert two.stats["replay/staleness_max"] == 1.0
    three = buf.mix(3, _step(3, version=3))  # step-1 rows 3 - 1 = 2 > k; step-2 rows (version 1) too
    assert three.stats["replay/evicted"] == 16 and three.stats["replay/samples"] == 0
    assert three.stats["replay/buffer"] == 8  # step 3's own rows


def test_rows_of_other_lengths_are_right_padded_masked_and_the_buffer_keeps_capacity_rows():
    buf = ReplayBuffer(0.5, capacity=10, max_staleness=2)
    buf.mix(0, _step(0, version=0, n=4, length=4))  # 2 + 4 = 6 tokens
    out = buf.mix(1, _step(1, version=1, n=4, length=1))  # 3 tokens: fresh rows padded to 6
    assert out.batch["input_ids"].shape == (8, 6)
    assert out.batch["versions"][0].tolist() == [-1, -1, 1, -1, -1, -1]  # -1 off the response
    assert out.batch["loss_mask"][0].tolist() == [0, 0, 1, 0, 0, 0]
    assert out.batch["attention_mask"][4].tolist() == [1] * 6  # a replayed row, whole
    assert out.stats["replay/buffer"] == 8
    assert buf.mix(2, _step(2, version=2, n=4)).stats["replay/buffer"] == 10  # 12 rows, the 2 oldest leave


def _executor(ratio: float = 0.5, capacity: int = 64, k: int = 2) -> ReplayExecutor:
    """A replay node's executor outside a run: no train_step consumes it (quantum 1), seed 0."""
    node = SimpleNamespace(name="replay", attrs={"ratio": ratio, "capacity": capacity})
    return ReplayExecutor(node, SimpleNamespace(plan=SimpleNamespace(nodes=[], staleness_bound=k), seed=0))


def _drawn(out: Advantages) -> list[tuple[str, int]]:
    return [(t.sample_id, t.meta[REPLAYED]) for t in out.trajectories if REPLAYED in t.meta]


def test_a_restored_executor_draws_exactly_the_rows_the_uninterrupted_one_draws(tmp_path):
    from runtime.checkpoint import read_state, write_checkpoint

    whole, restored, empty = _executor(), _executor(), _executor()
    assert isinstance(whole, Checkpointed)  # what the trainer's checkpoint asks of an executor
    for step in range(2):
        whole.run({"advantages": _step(step, version=step)}, {"step": step})
    state = whole.checkpoint_state()
    assert [r["first_step"] for r in state["rows"]] == [0] * 8 + [1] * 8  # oldest first
    # through trainer_state.pt as the trainer writes and reads it (torch.save / torch.load)
    folder = write_checkpoint(tmp_path, 2, lambda _: None, {"executors": {"replay": state}}, next_index=0)
    restored.load_checkpoint_state(read_state(folder)["executors"]["replay"])
    got = restored.checkpoint_state()["rows"]
    assert [r["trajectory"] for r in got] == [r["trajectory"] for r in state["rows"]]
    assert all(torch.equal(a["tensors"][key], b["tensors"][key]) for a, b in zip(got, state["rows"])
               for key in a["tensors"])
    # step 2: floor(0.5 x 8 / 0.5) = 8 of the 16 rows (2 - 0 <= k = 2: none evicted), the same 8 in the same order
    a = whole.run({"advantages": _step(2, version=2)}, {"step": 2})["advantages"]
    b = restored.run({"advantages": _step(2, version=2)}, {"step": 2})["advantages"]
    assert len(_drawn(a)) == 8 and _drawn(a) == _drawn(b)
    assert a.batch.keys() == b.batch.keys() and all(torch.equal(a.batch[k], b.batch[k]) for k in a.batch)
    assert a.stats == b.stats
    assert _drawn(empty.run({"advantages": _step(2, version=2)}, {"step": 2})["advantages"]) == []  # not restored


@pytest.mark.parametrize("state, match", [({}, "a buffer state is"), ({"rows": [{"trajectory": None}]}, "got dict"),
                                          ({"rows": [{"trajectory": None, "tensors": {}, "first_step": 0}] * 3},
                                           "3 rows, more than capacity=2")])
def test_a_state_that_is_not_a_buffer_is_refused_naming_the_node(state, match):
    with pytest.raises(ValueError, match=rf"node 'replay': replay: .*{match}"):
        _executor(capacity=2).load_checkpoint_state(state)


@pytest.mark.parametrize("knob", ["ratio=1.0", "ratio=-0.1", "ratio=True", "capacity=0", "capacity=2.5"])
def test_bad_knobs_are_refused_naming_the_node(knob):
    from areal_flow.ops.replay import check_knobs  # ops.replay calls it while tracing

    key, value = knob.split("=")
    args = {"ratio": 0.25, "capacity": 8, key: json.loads(value.lower())}
    with pytest.raises(GraphError, match=rf"node 'replay'.*{key}="):
        check_knobs("node 'replay'", args["ratio"], args["capacity"])


@pytest.mark.parametrize("override, match", [("replay.ratio=0.5x", "replay.ratio"), ("replay.ratio=1", "replay.ratio"),
                                             ("replay.capacity=0", "replay.capacity")])
def test_bad_config_keys_are_refused_naming_the_key(override, match):
    from areal_flow.config_load import load_config

    with pytest.raises((ConfigError, ValueError), match=match):
        load_config(REPO / "graphs/arith_grpo_replay.yaml", [override])


def test_a_replay_node_before_a_train_step_of_k_0_is_refused_at_trace(tmp_path):
    from areal_flow.cli import load_flow
    from areal_flow.config_load import load_config

    cfg = load_config(REPO / "graphs/arith_grpo_replay.yaml", ["async.max_staleness=0"])
    with pytest.raises(GraphError, match=r"node 'replay'.*max_staleness=0 evicts every one"):
        load_flow(GRAPH)(cfg)


@pytest.mark.slow
def test_a_run_trains_replayed_rows_within_k_and_every_fresh_sample_once_and_resumes_its_buffer(tmp_path):
    # 4 steps of 2 groups x 4 samples, k = 2, ratio 0.5: up to 8 replayed rows a step (measured ~45 s on 2 cores)
    run = ("train.steps=4", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false",
           "async.max_staleness=2", "replay.ratio=0.5", "train.checkpoint_every=2", f"out_dir={tmp_path}")
    cli_run(GRAPH, *run, "name=replay", timeout_s=400)
    trained = records(tmp_path / "replay")
    fresh = [t for t in trained if REPLAYED not in t["meta"]]
    again = [t for t in trained if REPLAYED in t["meta"]]
    assert len(fresh) == 4 * 2 * 4 and len({t["sample_id"] for t in fresh}) == 32  # each fresh sample once
    assert again, "no row was replayed"
    assert all(t["staleness"] <= 2 for t in trained)  # k, replayed rows too
    assert all(t["meta"][REPLAYED] < t["step"] for t in again)  # drawn from earlier steps
    assert all(t["staleness"] == t["step"] - min(v for v in t["versions"] if v >= 0) for t in again)
    per_step = [sum(t["step"] == s for t in again) for s in range(4)]
    assert per_step[0] == 0 and max(per_step) <= 8  # floor(0.5 x 8 / 0.5) = 8 at most
    summary = json.loads((tmp_path / "replay" / "summary.json").read_text())
    assert summary["samples_trained"] == 32 and summary["samples_replayed"] == len(again)
    # the buffer is in the checkpoint: a run resumed from version_2 replays at step 2 the rows the whole run did
    # (the draw depends on the buffer, the step's 8 fresh rows' count, the seed and the step alone)
    from runtime.checkpoint import read_state

    rows = read_state(tmp_path / "replay/checkpoints/version_2")["executors"]["replay"]["rows"]
    assert [r["first_step"] for r in rows] == [0] * 8 + [1] * 8  # capacity 256, nothing evicted before step 2
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "replay", cut)
    shutil.rmtree(cut / "model")
    shutil.rmtree(cut / "checkpoints/version_4")
    cli_run(GRAPH, *run, "name=cut", "--resume", str(cut), timeout_s=400)
    drawn = [[(t["sample_id"], t["meta"][REPLAYED]) for t in records(folder) if t["step"] == 2 and REPLAYED in t["meta"]]
             for folder in (tmp_path / "replay", cut)]
    assert per_step[2] > 0 and drawn[0] == drawn[1]
