"""Checkpoints that survive the machine (issue 26): a checkpoint torn at any byte is found
at resume and the one before it used, said in one line; a full disk during a write keeps the
run and the last complete checkpoint; ``train.keep_checkpoints`` rotates only after a new one
is complete. Checkpoint folders are written directly (``runtime.checkpoint``): no run."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.checkpoint import (MANIFEST, STATE_FILE, CheckpointWriteError, ResumeError, latest_checkpoint,
                                resume_point, rotate, save_checkpoint, write_checkpoint)
from runtime.checkpoint_integrity import torn

FILES = {  # one of each kind a checkpoint holds (module doc of runtime.checkpoint), a few hundred bytes each
    "model.safetensors": bytes(range(256)) * 3,
    "config.json": b'{"model_type": "llama", "hidden_size": 64}',
    "tokenizer.json": b'{"version": "1.0", "model": {"vocab": {"a": 0}}}',
    "critic/model.safetensors": bytes(range(255, -1, -1)) * 2,
    "trainer_dcp/.metadata": b"\x80\x04metadata" * 9,
    "trainer_dcp/__0_0.distcp": b"shard" * 50,
}
KINDS = [*FILES, STATE_FILE, MANIFEST]


def _fill(folder: Path) -> None:
    for name, data in FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


def _two_checkpoints(run: Path) -> tuple[Path, Path]:
    root = run / "checkpoints"
    return tuple(write_checkpoint(root, v, _fill, {"version": v, "rng": list(range(40))}, next_index=2 * v,
                                  strategies={"train_step": "d2"}) for v in (2, 4))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("pristine")
    _two_checkpoints(run)
    return run


def test_a_complete_checkpoint_lists_every_file_with_its_size_and_checksum(tmp_path):
    import json

    import xxhash

    _, v4 = _two_checkpoints(tmp_path)
    manifest = json.loads((v4 / MANIFEST).read_text())
    assert manifest["files"].keys() == {*FILES, STATE_FILE}
    for name, data in FILES.items():  # by the definition: size in bytes, xxHash64 of the bytes
        assert manifest["files"][name] == {"bytes": len(data), "xxh64": xxhash.xxh64(data).hexdigest()}
    assert torn(v4) is None and latest_checkpoint(tmp_path).version == 4


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(KINDS), how=st.sampled_from(["truncate", "flip"]), where=st.floats(0, 1, exclude_max=True),
       bit=st.integers(0, 7))
def test_a_checkpoint_torn_at_any_byte_is_skipped_for_the_one_before(pristine, tmp_path_factory, kind, how, where,
                                                                     bit):
    run = tmp_path_factory.mktemp("torn")
    shutil.copytree(pristine / "checkpoints", run / "checkpoints")
    v4 = run / "checkpoints" / "version_4"
    path = v4 / kind
    data = path.read_bytes()
    at = int(where * len(data))
    if how == "truncate":  # a crash or a copy cut the file at byte `at`
        path.write_bytes(data[:at])
    else:  # one bit flipped at byte `at` (the size stays)
        path.write_bytes(data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1:])
    lines: list[str] = []
    found = latest_checkpoint(run, say=lines.append)
    assert found.version == 2 and found.folder == run / "checkpoints" / "version_2"
    assert len(lines) == 1 and lines[0].startswith(f"skipping checkpoint {v4}: {kind} ")
    if kind != MANIFEST:  # the manifest lists every other file: its size, then its checksum, tell
        why = f"is {at} bytes, the manifest says {len(data)}" if how == "truncate" else "fails its xxh64 checksum"
        assert lines[0].endswith(f"{kind} {why}; falling back to the one before")


def test_a_missing_manifest_or_file_and_a_foreign_manifest_are_named(tmp_path):
    v2, v4 = _two_checkpoints(tmp_path)
    (v4 / "tokenizer.json").unlink()
    assert torn(v4) == "tokenizer.json is missing"
    (v4 / MANIFEST).unlink()  # e.g. a copy of the folder cut short
    assert torn(v4) == "no manifest.json"
    shutil.copy(v2 / MANIFEST, v4 / MANIFEST)  # another version's manifest, intact
    assert torn(v4) == "manifest.json is version 2's"
    lines: list[str] = []
    assert resume_point(str(tmp_path), tmp_path, say=lines.append).version == 2
    assert lines == [f"skipping checkpoint {v4}: manifest.json is version 2's; falling back to the one before"]
    (v2 / "model.safetensors").write_bytes(b"")
    with pytest.raises(ResumeError, match="no complete checkpoint under"):
        resume_point(str(tmp_path), tmp_path, say=lines.append)


def _disk_full_after(n: int):
    """A ``fill`` that writes ``n`` files, then fails as a full disk does."""
    def fill(folder: Path) -> None:
        for name, data in list(FILES.items())[:n]:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
        raise OSError(errno.ENOSPC, "No space left on device")
    return fill


def test_a_full_disk_keeps_the_last_checkpoint_and_training_goes_on(tmp_path):
    root = tmp_path / "checkpoints"
    v2, _ = _two_checkpoints(tmp_path)
    shutil.rmtree(root / "version_4")
    before = {p: p.read_bytes() for p in v2.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointWriteError) as failed:
        write_checkpoint(root, 4, _disk_full_after(3), {"version": 4}, next_index=8)
    assert failed.value.errno == errno.ENOSPC
    assert str(failed.value) == (f"checkpoint {root / 'version_4'} not written (ENOSPC: No space left on "
                                 "device); removed version_4.tmp")
    assert sorted(p.name for p in root.iterdir()) == ["version_2"]  # the .tmp folder is gone
    lines: list[str] = []  # what the trainer does (runtime.stage_worker): say it, keep the last one, go on
    assert save_checkpoint(root, 4, _disk_full_after(0), {"version": 4}, next_index=8, strategies={}, keep=1,
                           last=v2, say=lines.append) is None
    assert lines == [f"checkpoint {root / 'version_4'} not written (ENOSPC: No space left on device); removed "
                     f"version_4.tmp; {v2} stays the last complete checkpoint; training goes on"]
    assert {p: p.read_bytes() for p in v2.rglob("*") if p.is_file()} == before  # keep=1 rotated nothing
    assert latest_checkpoint(tmp_path).version == 2
    # space again at the next checkpoint: it is written, and only then is version_2 rotated away (keep=1)
    assert save_checkpoint(root, 6, _fill, {"version": 6}, next_index=12, strategies={}, keep=1, last=v2,
                           say=lines.append) == root / "version_6"
    assert sorted(p.name for p in root.iterdir()) == ["version_6"] and len(lines) == 1


def test_a_checkpoint_is_not_tried_on_a_disk_with_less_room_than_the_last_one(tmp_path, monkeypatch):
    import shutil as shutil_module
    from types import SimpleNamespace

    root = tmp_path / "checkpoints"
    v2, _ = _two_checkpoints(tmp_path)
    need = sum(len(data) for data in FILES.values()) + (v2 / STATE_FILE).stat().st_size  # what version_2 holds
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: SimpleNamespace(free=need - 1))
    lines: list[str] = []

    def fill(folder: Path) -> None:
        raise AssertionError("the write was tried")

    assert save_checkpoint(root, 6, fill, {"version": 6}, next_index=12, strategies={}, keep=1, last=v2,
                           say=lines.append) is None
    assert lines == [f"checkpoint {root / 'version_6'} not written (ENOSPC: {need / 2**20:.1f} MiB needed, as "
                     f"version_2 holds, {(need - 1) / 2**20:.1f} MiB free); {v2} stays the last complete checkpoint; "
                     "training goes on"]
    assert sorted(p.name for p in root.iterdir()) == ["version_2", "version_4"]  # nothing written, nothing rotated


def test_keep_checkpoints_rotates_old_ones_after_the_new_one_is_complete(tmp_path):
    root = tmp_path / "checkpoints"
    for v in (1, 2, 3):
        write_checkpoint(root, v, _fill, {"version": v}, next_index=v)
    assert rotate(root, 3, keep=0) == [] and len(list(root.iterdir())) == 3  # 0 keeps all
    (root / "version_2" / "config.json").write_bytes(b"{}")  # torn: never counted among the kept
    (root / "version_9").mkdir()  # left by an attempt that died after its resume point: not older, not touched
    assert rotate(root, 3, keep=2) == [root / "version_2"]  # version_3 and the newest complete before it
    assert sorted(p.name for p in root.iterdir()) == ["version_1", "version_3", "version_9"]
    for v in (4, 5):
        write_checkpoint(root, v, _fill, {"version": v}, next_index=v)
        rotate(root, v, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["version_4", "version_5", "version_9"]
    assert latest_checkpoint(tmp_path).version == 5  # version_9 has no manifest: skipped


def test_a_checkpoint_written_before_checksums_is_checked_by_its_sizes(tmp_path):
    """A manifest of the older format (``files``: name -> size in bytes, no checksums) still
    resumes: its sizes are checked as they were then; a wrong size still makes it torn."""
    import json

    _, v4 = _two_checkpoints(tmp_path)
    manifest = json.loads((v4 / MANIFEST).read_text())
    manifest["files"] = {name: entry["bytes"] for name, entry in manifest["files"].items()}
    del manifest["manifest_xxh64"]
    (v4 / MANIFEST).write_text(json.dumps(manifest))
    assert torn(v4) is None and latest_checkpoint(tmp_path).version == 4
    (v4 / "config.json").write_bytes(b"{}")  # 2 bytes where the manifest says 43
    assert torn(v4) == f"config.json is 2 bytes, the manifest says {len(FILES['config.json'])}"
    assert latest_checkpoint(tmp_path).version == 2
