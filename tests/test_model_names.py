"""One model name, one meaning: the compiler's shape (``compiler.models.resolve_model``) and
the run's weights folder (``areal_flow.models.hf.resolve_folder``,
``runtime.model_source._initial_folder``) both come from ``areal_flow.models.names``.

No network: hub ids are read from a monkeypatched Hugging Face cache, and the download and
GGUF conversion calls are replaced by recorders.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import areal_flow.models.hf as hf
import compiler.models as cm
from areal_flow.cli import main as cli_main
from areal_flow.models.names import ModelName, ModelNameError, resolve_name
from compiler.models import ModelSpecError, resolve_model
from runtime.model_source import _initial_folder

# A hand-written config.json: 2 layers, width 64, 4 heads (head_dim 64 / 4 = 16), 2 KV heads.
TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}


def _write_gguf(path: Path) -> None:
    """A GGUF file with hand-chosen metadata: llama, 3 blocks, width 32, MLP 96, 4/1 heads, 7 tokens."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(3)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(1)
    writer.add_token_list([f"t{i}" for i in range(7)])
    writer.add_tensor("token_embd.weight", np.zeros((7, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def sides(tmp_path, monkeypatch):
    """Both entry points with their side effects recorded: every ``resolve_name`` result per
    side, the run's downloads (hub ids), GGUF conversions (source path) and warm starts."""
    seen = {"compile": [], "run": [], "download": [], "convert": [], "warm_start": []}

    def spy(side):
        def wrapped(name):
            ref = resolve_name(name)
            seen[side].append(ref)
            return ref
        return wrapped

    monkeypatch.setattr(cm, "resolve_name", spy("compile"))
    monkeypatch.setattr("areal_flow.models.names.resolve_name", spy("run"))
    monkeypatch.setattr(hf, "resolve_name", spy("run"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("AREAL_FLOW_CACHE", str(tmp_path / "cache"))

    def download(repo_id, allow_patterns):
        seen["download"].append(repo_id)
        return str(tmp_path / "downloaded")

    def convert(gguf_path, target, source):
        seen["convert"].append(gguf_path)

    def warm_start(task, preset, cfg, progress):
        seen["warm_start"].append(preset)
        return tmp_path / "warm" / preset

    monkeypatch.setattr("huggingface_hub.snapshot_download", download)
    monkeypatch.setattr(hf, "_convert_gguf", convert)
    monkeypatch.setattr(hf, "find_packaged_gguf", lambda package, filename: tmp_path / filename)
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"\0" * 8)
    monkeypatch.setattr("runtime.engines.sft.warm_start", warm_start)
    return seen


def _run(spec: str) -> Path:
    return _initial_folder(spec, {}, 0, None, False)


def _cache_snapshot(tmp_path: Path, hub_id: str) -> Path:
    snapshot = tmp_path / "hub" / f"models--{hub_id.replace('/', '--')}" / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(TINY_CONFIG))
    return snapshot


@pytest.mark.parametrize("spec, kind, preset", [
    ("tiny-arith", "tiny", "tiny-arith"),
    ("TINY-Arith", "tiny", "tiny-arith"),  # case ignored on both sides
    ("smollm2-135m", "preset", "smollm2-135m"),
    ("SMOLLM2-135M", "preset", "smollm2-135m"),  # the GGUF preset (weights) wins over the shape of the same letters
])
def test_a_preset_name_means_the_same_preset_on_both_sides(sides, spec, kind, preset, tmp_path):
    shape = resolve_model(spec)
    folder = _run(spec)
    assert sides["compile"] == sides["run"] == [ModelName(spec, kind, preset=preset)]
    if kind == "tiny":
        assert shape.name == preset and shape.hidden == 128  # tiny-arith: hidden 128 (presets.py)
        assert sides["warm_start"] == [preset] and folder == tmp_path / "warm" / preset
    else:
        assert shape.name == "SmolLM2-135M" and (shape.n_layers, shape.hidden) == (30, 576)  # its config.json
        assert folder == tmp_path / "cache" / "models" / "smollm2-135m"
        assert sides["convert"] == [tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_a_published_shape_is_costed_but_not_run(sides):
    assert resolve_model("qwen2.5-7b").hidden == 3584  # Qwen2.5-7B's config.json
    with pytest.raises(ValueError, match="shape only.*org/Qwen2.5-7B"):
        _run("qwen2.5-7b")
    assert sides["compile"] == sides["run"] == [ModelName("qwen2.5-7b", "shape", preset="Qwen2.5-7B")]
    assert sides["download"] == []


def test_a_hub_id_of_a_preset_is_the_hub_repository_on_both_sides(sides, tmp_path):
    # not cached: the compiler costs the preset's shape, the run downloads the repository
    assert resolve_model("Qwen/qwen2.5-7b").hidden == 3584
    assert _run("Qwen/qwen2.5-7b") == tmp_path / "downloaded"
    expected = ModelName("Qwen/qwen2.5-7b", "hub", preset="Qwen2.5-7B", hub_id="Qwen/qwen2.5-7b")
    assert sides["compile"] == sides["run"] == [expected]
    assert sides["download"] == ["Qwen/qwen2.5-7b"]


def test_a_cached_hub_id_is_read_from_its_snapshot(sides, tmp_path):
    snapshot = _cache_snapshot(tmp_path, "acme/tiny-lm")
    shape = resolve_model("acme/tiny-lm")
    assert shape.name == str(snapshot / "config.json") and (shape.hidden, shape.head_dim) == (64, 16)
    _run("acme/tiny-lm")
    assert sides["compile"] == sides["run"] == [ModelName("acme/tiny-lm", "hub", path=snapshot, hub_id="acme/tiny-lm")]
    assert sides["download"] == ["acme/tiny-lm"]


def test_a_local_folder_is_itself_on_both_sides(sides, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    assert resolve_model(str(folder)).name == str(folder / "config.json")
    assert _run(str(folder)) == folder
    assert sides["compile"] == sides["run"] == [ModelName(str(folder), "folder", path=folder)]


def test_a_gguf_file_is_read_and_converted_from_the_same_path(sides, tmp_path):
    path = tmp_path / "m.gguf"
    _write_gguf(path)
    shape = resolve_model(str(path))
    assert (shape.n_layers, shape.hidden, shape.intermediate, shape.n_heads, shape.n_kv_heads, shape.vocab) == \
        (3, 32, 96, 4, 1, 7)
    folder = _run(str(path))
    assert sides["compile"] == sides["run"] == [ModelName(str(path), "gguf", path=path)]
    assert sides["convert"] == [path.resolve()] and folder.parent == tmp_path / "cache" / "models"


def test_an_unknown_name_is_one_error_on_both_sides_and_from_the_cli(sides, capsys):
    with pytest.raises(ModelSpecError) as compile_err:
        resolve_model("no-such-model")
    with pytest.raises(ModelNameError) as run_err:
        _run("no-such-model")
    with pytest.raises(ModelNameError) as folder_err:
        hf.resolve_folder("no-such-model")
    message = str(run_err.value)
    assert str(compile_err.value) == message == str(folder_err.value)
    assert message.startswith("model.path 'no-such-model': not a preset")
    assert all(preset in message for preset in ("tiny-arith", "smollm2-135m", "Qwen2.5-7B"))
    code = cli_main(["compile", "graphs/gsm8k_grpo.py", "--config", "graphs/gsm8k_grpo.yaml",
                     "model.path=no-such-model"])
    assert code == 2
    assert capsys.readouterr().err.strip() == f"areal-flow: error: {message}"


@pytest.mark.parametrize("spec", ["", "   ", "Qwen2.5-7B-Instruct", "gpt2", "a/b/c"])
def test_names_that_refer_to_nothing(spec):
    with pytest.raises(ModelNameError, match="presets: tiny-s"):
        resolve_name(spec)
