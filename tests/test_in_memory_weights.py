"""A CPU worker's weights in its own memory (``areal_flow.models.in_memory``, through
``runtime.model_source.load_pretrained(in_memory=True)`` and ``ValueModel.from_policy(in_memory=True)``):
out of the checkpoint file's copy-on-write mapping, so the first write to them (an optimizer step,
an engine's weight update) takes no page faults; ties kept, values unchanged. Faults counted by the
kernel (``getrusage``), against the pages the parameters span (``resource.getpagesize()``)."""

import resource
from pathlib import Path

import pytest
import torch

from areal_flow.models.tiny import build_model
from areal_flow.models.tokenizer import build_char_tokenizer
from runtime.model_source import load_pretrained


@pytest.fixture
def folder(tmp_path) -> Path:
    tokenizer = build_char_tokenizer()
    build_model("tiny-s", len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def _mapped(path: Path) -> bool:
    return any(str(path) in line for line in Path("/proc/self/maps").read_text().splitlines())


def _faults_writing(model) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_in_memory_weights_leave_the_files_mapping_and_take_no_faults_when_written(folder):
    weights_file = folder / "model.safetensors"
    pages = sum(p.numel() * p.element_size() for p in load_pretrained(folder)[0].parameters()) // resource.getpagesize()

    mapped, _ = load_pretrained(folder)
    assert _mapped(weights_file)  # from_pretrained maps the file: a first write copies each page
    assert _faults_writing(mapped) >= pages // 2
    del mapped

    model, _ = load_pretrained(folder, in_memory=True)
    assert not _mapped(weights_file)
    assert _faults_writing(model) < pages // 8


def test_in_memory_weights_keep_ties_and_values(folder):
    plain, _ = load_pretrained(folder)
    model, _ = load_pretrained(folder, in_memory=True)
    tied = plain.lm_head.weight is plain.get_input_embeddings().weight
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    assert model.state_dict().keys() == plain.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, plain.state_dict()[name]), name


def test_a_critic_built_in_memory_leaves_the_policys_file_and_writes_without_faults(folder):
    from areal_flow.models.critic import ValueModel

    weights_file = folder / "model.safetensors"
    mapped = ValueModel.from_policy(folder)
    pages = sum(p.numel() * p.element_size() for p in mapped.backbone.parameters()) // resource.getpagesize()
    assert _mapped(weights_file) and _faults_writing(mapped.backbone) >= pages // 2
    del mapped
    critic = ValueModel.from_policy(folder, in_memory=True)
    assert not _mapped(weights_file)
    assert _faults_writing(critic.backbone) < pages // 8
