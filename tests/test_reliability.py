"""Reliability (issue 13): late duplicates, failing rewards, versions, EOS ids, empty
responses, run folders. Hand-computed expectations; loopback only; seconds each."""

from __future__ import annotations

from types import SimpleNamespace

from areal_flow.types import Trajectory
from runtime.staleness import OrderedExperienceBuffer
from runtime.workers import GroupItem, file_group

PLAN = SimpleNamespace(nodes=[SimpleNamespace(name="generate", grain="stream")])


def _traj(index: int, j: int, version: int = 0, text: str = "1") -> Trajectory:
    return Trajectory(f"{index}:{j}", index, [1], [5], [-0.5], [version], "stop", output_text=text,
                      meta={"answer": "1"})


def _item(index: int, n: int = 2) -> GroupItem:
    return GroupItem(index, 1, {"generate.rollouts": [_traj(index, j) for j in range(n)]})


def test_a_late_duplicate_group_is_dropped_and_counted_held_or_trained():
    buffer, items, counts = OrderedExperienceBuffer(batch_groups=2, max_staleness=1), {}, {"duplicates": 0}
    assert file_group(_item(0), items, buffer, counts, PLAN)
    assert not file_group(_item(0), items, buffer, counts, PLAN)  # held: dropped
    assert file_group(_item(1), items, buffer, counts, PLAN)
    buffer.take_batch(0)  # indices 0 and 1 trained (the trainer pops them from items)
    items.clear()
    assert not file_group(_item(1), items, buffer, counts, PLAN)  # trained: dropped
    assert counts["duplicates"] == 2 and buffer.pending == 0


def _random_tiny(folder, eos=None):
    """tiny-arith with N(0, 0.3^2) weights (non-degenerate greedy tokens), saved to ``folder``
    with ``generation_config.eos_token_id = eos`` when given; loaded back as the runtime does."""
    import torch

    from areal_flow.models.tiny import build_model
    from areal_flow.models.tokenizer import build_char_tokenizer
    from runtime.model_source import load_pretrained

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_model("tiny-arith", len(tok), seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    if eos is not None:
        model.generation_config.eos_token_id = eos
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return load_pretrained(folder)


def test_every_eos_id_of_the_generation_config_stops_a_sequence(tmp_path):
    from runtime.engines.generation import GenerationEngine, GenerationRequest, SamplingParams, stop_token_ids

    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    model, tok = _random_tiny(tmp_path / "one")
    prompt = tok.encode("12+5=")
    plain = GenerationEngine(model, tok, max_batch_size=1).generate([GenerationRequest("a", prompt, greedy)])[0]
    first = plain.output_ids[0]
    assert tok.eos_token_id == 2 and first != 2 and len(plain.output_ids) > 1  # the control: it goes on
    model, tok = _random_tiny(tmp_path / "two", eos=[2, first])  # a second EOS id: the first greedy token
    engine = GenerationEngine(model, tok, max_batch_size=1)
    assert engine.eos_ids == {2, first} == stop_token_ids(tok, [2, first])
    out = engine.generate([GenerationRequest("b", prompt, greedy)])[0]
    assert out.output_ids == [first] and out.finish_reason == "stop"


def test_the_vllm_engine_reads_every_eos_id_of_the_folder(tmp_path):
    """vLLM gets them as ``stop_token_ids`` (``VLLMEngine._add``; the engine itself runs in
    ``make test-vllm``); here the folder reading both engines share."""
    from runtime.engines.generation import generation_config_eos, stop_token_ids

    _, tok = _random_tiny(tmp_path, eos=[7, 2])
    assert generation_config_eos(tmp_path) == [7, 2]
    assert stop_token_ids(tok, generation_config_eos(tmp_path)) == {2, 7}
    assert generation_config_eos(tmp_path / "nowhere") is None and stop_token_ids(tok, None) == {2}
