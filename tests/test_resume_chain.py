"""Checkpoints and exact resume of a chain of step groups (issue 24): PPO's critic on a mesh
of its own (``gen:d1 + train:d1 + critic_step:d1``) checkpoints each group's part at the same
version (``runtime.checkpoint``: the policy trainer's ``version_<v>/``, the critic group's
``parts/critic_step/version_<v>/``). At k = 0 a run whose critic worker is killed, or whose
driver is killed and resumed, ends with the uninterrupted run's policy and critic bit for
bit, every sample trained once and every step once; a version whose critic part is torn is
skipped for the one before, in one line, and the resume (local and Ray) reaches the same
weights; so does a critic on 2 ranks of its own mesh, whose part holds its ranks' shards.
Counts: 6 steps x B=2 groups x n=4 samples, by hand."""

from __future__ import annotations

import errno
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime.checkpoint import MANIFEST, latest_checkpoint, rotate, save_checkpoint, write_checkpoint
from test_resume import B, N, STEPS, _event_steps, _exactly_once, _finish, _kill_trainer_after, _same, _weights

REPO = Path(__file__).resolve().parents[1]
RUN = [str(REPO / "graphs/arith_ppo.py"), "cluster.n_gpus_per_node=3",
       "compile.allocation=gen:d1 + train:d1 + critic_step:d1", f"train.steps={STEPS}", "train.checkpoint_every=2",
       "warm_start.steps=10", f"train.batch_size={B}", f"gen.n_samples={N}", "eval.enabled=false",
       "async.max_staleness=0", "scheduler.threads_per_worker=1"]


def _cli(tmp_path: Path, name: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "areal_flow.cli", "run", *RUN, f"out_dir={tmp_path}",
                             f"name={name}", *extra], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.fixture(scope="module")
def chain_whole(tmp_path_factory) -> Path:
    """The uninterrupted chain run at k = 0, which the interrupted ones must reproduce."""
    tmp = tmp_path_factory.mktemp("chain")
    _finish(_cli(tmp, "whole"))
    return tmp / "whole"


def _both_models_same(out: Path, whole: Path) -> bool:
    return all(_same(_weights(out / m), _weights(whole / m)) for m in ("model", "critic"))


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["local", "ray"])
def test_each_step_group_writes_its_part_and_a_torn_critic_part_falls_back_to_the_version_before(
        tmp_path, chain_whole, scheduler):
    for v in (2, 4, 6):  # every group's part at every checkpointed version
        manifest = json.loads((chain_whole / f"checkpoints/version_{v}" / MANIFEST).read_text())
        assert manifest["parts"] == ["critic_step"] and manifest["next_index"] == v * B
        part = chain_whole / f"checkpoints/parts/critic_step/version_{v}"
        assert json.loads((part / MANIFEST).read_text())["strategies"] == {"critic_step": "d1"}
        assert (part / "critic/model.safetensors").is_file() and not (part / "model.safetensors").exists()
    assert latest_checkpoint(chain_whole).version == STEPS
    out = tmp_path / "torn"
    shutil.copytree(chain_whole, out)
    weights = out / f"checkpoints/parts/critic_step/version_{STEPS}/critic/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1  # one bit flipped, the size kept
    weights.write_bytes(bytes(data))
    err = _finish(_cli(tmp_path, "torn", "--resume", str(out), f"scheduler.type={scheduler}"))  # each actor its part
    skipped = [line for line in err.splitlines() if "skipping checkpoint" in line]
    assert skipped == [f"areal-flow: skipping checkpoint {out}/checkpoints/version_{STEPS}: its part "
                       f"parts/critic_step/version_{STEPS}: critic/model.safetensors fails its xxh64 checksum; "
                       "falling back to the one before"]
    assert f"resuming {out} from version_{STEPS - 2} (step {STEPS - 2} of {STEPS})" in err
    assert _both_models_same(out, chain_whole)  # steps 4 and 5 trained again from both groups' version 4
    _exactly_once(out, k=0)


@pytest.mark.slow
def test_a_killed_critic_worker_restarts_every_group_from_its_part_bit_for_bit(tmp_path, chain_whole):
    killed: dict = {}
    proc = _cli(tmp_path, "critic", "scheduler.max_restarts=1")
    killer = threading.Thread(target=_kill_trainer_after, args=(tmp_path / "critic", 2, killed, "critic_step-0"),
                              daemon=True)
    killer.start()
    err = _finish(proc)
    killer.join(timeout=5)
    assert killed, "the critic's worker was not killed"
    restart = re.search(r"critic_step/0 died \(exit code -9\); restarting every worker from version_(\d+) at step "
                        r"(\d+) \(1/1 restarts\)", err)
    assert restart and restart[1] == restart[2] and int(restart[1]) in (2, 4), err[-3000:]
    out = tmp_path / "critic"
    assert _both_models_same(out, chain_whole)
    _exactly_once(out, k=0)
    assert _event_steps(out) == list(range(STEPS))  # each step once in TensorBoard
    restarts = json.loads((out / "summary.json").read_text())["restarts"]
    assert restarts["trainer_restarts"] == 1 and restarts["causes"] == ["critic_step/0 died (exit code -9)"]


@pytest.mark.slow
def test_a_killed_driver_resumes_every_group_from_its_part_bit_for_bit(tmp_path, chain_whole):
    out = tmp_path / "driver"
    proc = _cli(tmp_path, "driver")
    deadline = time.monotonic() + 400
    while latest_checkpoint(out) is None:
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the kill"
        time.sleep(0.05)
    proc.kill()
    proc.communicate(timeout=60)
    cut = latest_checkpoint(out)
    assert cut.version < STEPS and not (out / "model").exists()
    err = _finish(_cli(tmp_path, "driver", "resume=auto"))
    assert f"resuming {out} from version_{cut.version} (step {cut.version} of {STEPS})" in err
    assert _both_models_same(out, chain_whole)
    _exactly_once(out, k=0)
    assert _event_steps(out) == list(range(STEPS))


@pytest.mark.slow
def test_a_critic_on_two_ranks_of_its_own_mesh_resumes_its_sharded_part_bit_for_bit(tmp_path):
    # the critic on 2 ranks of its own mesh (runtime.trainer_ranks): its part holds the ranks'
    # DCP shards (critic/trainer_dcp); one bit flipped in a shard of the last version falls back
    # to the version before, and the resume ends with the uninterrupted run's models bit for bit
    two = [arg for arg in RUN if not arg.startswith(("cluster.", "compile."))]
    two += ["cluster.n_gpus_per_node=4", "compile.allocation=gen:d1 + train:d1 + critic_step:d2"]
    whole = tmp_path / "whole"
    _finish(subprocess.Popen([sys.executable, "-m", "areal_flow.cli", "run", *two, f"out_dir={tmp_path}",
                              "name=whole"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    part = whole / f"checkpoints/parts/critic_step/version_{STEPS}"
    assert json.loads((part / MANIFEST).read_text())["strategies"] == {"critic_step": "d2"}
    shards = sorted((part / "critic/trainer_dcp").glob("*.distcp"))
    assert len(shards) == 2  # one file a rank
    out = tmp_path / "torn"
    shutil.copytree(whole, out)
    shard = out / shards[1].relative_to(whole)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    err = _finish(subprocess.Popen([sys.executable, "-m", "areal_flow.cli", "run", *two, f"out_dir={tmp_path}",
                                    "name=torn", "--resume", str(out)], cwd=REPO, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True))
    assert f"skipping checkpoint {out}/checkpoints/version_{STEPS}: its part parts/critic_step/version_{STEPS}: " \
           f"critic/trainer_dcp/{shards[1].name} fails its xxh64 checksum" in err, err[-3000:]
    assert f"resuming {out} from version_{STEPS - 2} (step {STEPS - 2} of {STEPS})" in err
    assert _both_models_same(out, whole)
    _exactly_once(out, k=0)


def _fill(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"w" * 64)


def test_a_full_disk_during_one_part_only_leaves_the_version_torn_and_training_on(tmp_path):
    """Written directly (no run): the trainer's part of version 3 is written, then the disk is
    full while the critic group (``c``) writes its part. The critic's group says so in one line
    naming its folder and its last complete part; nothing of the failed part is left; version 3
    is skipped at resume for version 2 (naming the missing part) and rotates nothing; version 4,
    written in full once there is room, completes the chain and rotates as usual (keep = 2)."""
    root, said = tmp_path / "checkpoints", []

    def full(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"w" * 16)
        raise OSError(errno.ENOSPC, "No space left on device")

    def save(v: int, part: str | None, fill=_fill, last=None):
        return save_checkpoint(root, v, fill, {"version": v}, next_index=v, strategies={}, keep=2, last=last,
                               say=said.append, part=part, parts=() if part else ("c",))

    for v in (1, 2):
        save(v, None)
        last_c = save(v, "c")
    save(3, None)
    assert save(3, "c", fill=full, last=last_c) is None
    assert said == [f"checkpoint {root}/parts/c/version_3 not written (ENOSPC: No space left on device); removed "
                    f"version_3.tmp; {root}/parts/c/version_2 stays the last complete checkpoint; training goes on"]
    assert sorted(p.name for p in (root / "parts/c").iterdir()) == ["version_1", "version_2"]  # no .tmp left
    assert sorted(p.name for p in root.glob("version_*")) == ["version_1", "version_2", "version_3"]
    lines: list[str] = []
    assert latest_checkpoint(tmp_path, say=lines.append).version == 2
    assert lines == [f"skipping checkpoint {root}/version_3: its part parts/c/version_3: no manifest.json; "
                     "falling back to the one before"]
    save(4, None)
    save(4, "c", last=last_c)  # version 4 complete: keep = 2 keeps versions 4 and 2, the torn 3 goes
    assert sorted(p.name for p in root.glob("version_*")) == ["version_2", "version_4"]
    assert sorted(p.name for p in (root / "parts/c").iterdir()) == ["version_2", "version_4"]
    assert latest_checkpoint(tmp_path).version == 4 and len(said) == 1


def test_a_version_is_complete_only_with_every_part_and_rotation_keeps_whole_versions(tmp_path):
    """Written directly (no run): the trainer's ``version_<v>`` lists the part ``c``; a version
    whose part is missing is skipped, and ``keep_checkpoints=2`` deletes only after a version is
    complete in every part, the parts of the versions it drops with them."""
    root, said = tmp_path / "checkpoints", []

    def save(v: int, part: str | None) -> None:
        save_checkpoint(root, v, _fill, {"version": v}, next_index=v, strategies={}, keep=2, last=None,
                        say=said.append, part=part, parts=() if part else ("c",))

    for v in (1, 2, 3):
        save(v, None)
        save(v, "c")
    assert sorted(p.name for p in (root / "parts/c").iterdir()) == ["version_2", "version_3"]
    assert sorted(p.name for p in root.glob("version_*")) == ["version_2", "version_3"]
    save(4, None)  # the trainer's part of version 4; the critic group's not yet: nothing rotated
    assert sorted(p.name for p in root.glob("version_*")) == ["version_2", "version_3", "version_4"]
    lines: list[str] = []
    found = latest_checkpoint(tmp_path, say=lines.append)
    assert found.version == 3 and found.strategies() == {}
    assert lines == [f"skipping checkpoint {root}/version_4: its part parts/c/version_4: no manifest.json; "
                     "falling back to the one before"]
    save(4, "c")  # version 4 complete: the group completing it rotates every part
    assert sorted(p.name for p in root.glob("version_*")) == ["version_3", "version_4"]
    assert sorted(p.name for p in (root / "parts/c").iterdir()) == ["version_3", "version_4"]
    assert rotate(root, 4, keep=2) == [] and latest_checkpoint(tmp_path).version == 4 and said == []
    write_checkpoint(root / "parts/c", 5, _fill, {"version": 5}, next_index=5)  # a part ahead of the trainer's
    assert latest_checkpoint(tmp_path).version == 4  # no version_5 of the trainer's: not a version yet
