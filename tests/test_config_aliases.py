"""Aliases of our config keys, suggestions by meaning, model.dtype, and the new sections."""

from __future__ import annotations

import pytest

from areal_flow.config import ConfigError

from areal_flow.config_load import load_config
from areal_flow.config_keys import ALIASES, describe_keys, field_docs, suggest


def test_aliases_on_the_command_line():
    cfg = load_config(None, ["training.seed=5", "training.bf16=true", "model.activation_checkpointing=false",
                             "rollout.max_head_offpolicyness=0", "gconfig.n_samples=4", "actor.path=smollm2-135m"])
    assert (cfg.seed, cfg.model.dtype, cfg.compile.activation_checkpointing) == (5, "bfloat16", False)
    assert (cfg.async_.max_staleness, cfg.gen.n_samples, cfg.model.path) == (0, 4, "smollm2-135m")
    assert load_config(None, ["training.fp16=true"]).model.dtype == "float16"
    assert load_config(None, ["training.fp16=false"]).model.dtype == "float32"  # false changes nothing


def test_aliases_in_yaml_with_line_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  seed: 9\n  bf16: true\nasync:\n  max_staleness: 3\n"
                    "actor:\n  optimizer:\n    lr: 0.25\n")
    cfg = load_config(path)
    assert (cfg.seed, cfg.model.dtype, cfg.async_.max_staleness, cfg.train.lr) == (9, "bfloat16", 3, 0.25)
    path.write_text("training:\n  seed: nine\n")
    with pytest.raises(ConfigError, match=rf"'seed' \({path}:2\)"):  # the alias's line
        load_config(path)
    path.write_text("training:\n  fp16: maybe\n")
    with pytest.raises(ConfigError, match=r"training.fp16 \(alias of model.dtype\)"):
        load_config(path)


def test_gradient_accumulation_is_kept_for_the_plan_and_auto_checkpointing_is_the_default():
    # the HF name sets train.gradient_accumulation_steps; micro_batch_size is left as given (the
    # plan's micro-batches come from the count: tests/test_memory_knobs.py)
    cfg = load_config(None, ["train.batch_size=8", "gen.n_samples=8", "training.gradient_accumulation_steps=4"])
    assert (cfg.train.gradient_accumulation_steps, cfg.train.micro_batch_size) == (4, 32)
    assert load_config(None, []).compile.activation_checkpointing is None  # auto
    assert load_config(None, ["model.activation_checkpointing=auto"]).compile.activation_checkpointing is None
    assert load_config(None, ["actor.gradient_checkpointing=true"]).compile.activation_checkpointing is True


def test_our_own_activation_checkpointing_key_takes_auto_as_the_docs_say(tmp_path):
    """``compile.activation_checkpointing`` is ``bool | None``; ``auto`` (USAGE.md) means None, from
    a YAML file or the command line, and an override's ``auto`` resets a file's ``true``."""
    from areal_flow.config import ConfigError

    path = tmp_path / "ac.yaml"
    path.write_text("compile:\n  activation_checkpointing: true\n")
    assert load_config(path).compile.activation_checkpointing is True
    assert load_config(path, ["compile.activation_checkpointing=auto"]).compile.activation_checkpointing is None
    assert load_config(None, ["compile.activation_checkpointing=false"]).compile.activation_checkpointing is False
    path.write_text("compile:\n  activation_checkpointing: auto\n")
    assert load_config(path).compile.activation_checkpointing is None
    path.write_text("seed: 2\ncompile:\n  activation_checkpointing: maybe\n")
    with pytest.raises(ConfigError, match=r"ac.yaml: line 3: compile.activation_checkpointing: expected true, false or auto"):
        load_config(path)


@pytest.mark.parametrize("typed, meant", [
    ("train.learning_rate", "train.lr"), ("train.epochs", "train.steps"), ("train.batch", "train.batch_size"),
    ("gen.group_size", "gen.n_samples"), ("train.lrr", "train.lr"), ("train.precision", "model.dtype"),
    ("training.seed", "seed"),
])
def test_suggestions_by_meaning_then_spelling(typed, meant):
    from areal_flow.config import ExperimentConfig
    from areal_flow.config_load import all_keys, yaml_key

    assert suggest(typed, [yaml_key(k) for k in all_keys(ExperimentConfig)]) == meant


def test_unknown_key_error_suggests_by_meaning():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.learning_rate' \(command line\); "
                                          r"did you mean 'train.lr'\?"):
        load_config(None, ["train.learning_rate=1e-4"])


@pytest.mark.parametrize("given, canonical", [("fp32", "float32"), ("BF16", "bfloat16"), ("bfloat16", "bfloat16"),
                                              ("fp16", "float16"), ("float16", "float16"), ("AUTO", "auto")])
def test_model_dtype_spellings(given, canonical):
    assert load_config(None, [f"model.dtype={given}"]).model.dtype == canonical


def test_model_dtype_rejects_banana_naming_the_key():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.dtype=banana"])
    assert str(info.value).startswith("model.dtype='banana': expected auto or one of") and "\n" not in str(info.value)


def test_logging_and_debug_sections():
    cfg = load_config(None, ["debug.memory_profiler=true", "logging.wandb_mode=disabled"])
    assert cfg.debug.memory_profiler and cfg.logging.wandb_mode == "disabled" and not cfg.logging.wandb
    with pytest.raises(ConfigError, match="logging.wandb_mode='sometimes'"):
        load_config(None, ["logging.wandb_mode=sometimes"])


def test_wandb_on_without_the_package_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logging.wandb=true needs the wandb package: pip install"):
        load_config(None, ["logging.wandb=true"])


def test_every_alias_target_is_a_key_and_every_key_is_documented():
    from areal_flow.config import ExperimentConfig

    rows = describe_keys(ExperimentConfig)
    keys = {key for key, *_ in rows}
    assert {a.target for a in ALIASES} <= keys
    assert [key for key, _, _, doc in rows if not doc] == []
    assert ("train.lr", "float", "0.001", "AdamW learning rate.") in rows


def test_field_docs_reads_attribute_docstrings():
    from dataclasses import dataclass

    @dataclass
    class Example:
        a: int = 1
        """The a.
        Two lines."""
        b: int = 2

    assert field_docs(Example) == {"a": "The a. Two lines."}


def test_load_pretrained_honours_the_dtype_name(tmp_path):
    import torch

    from areal_flow.models.tiny import build_model
    from areal_flow.models.tokenizer import build_char_tokenizer
    from areal_flow.dtypes import torch_dtype
    from runtime.model_source import load_pretrained

    assert (torch_dtype("bf16"), torch_dtype("float16"), torch_dtype(torch.float32)) == (
        torch.bfloat16, torch.float16, torch.float32)
    with pytest.raises(ValueError, match="model.dtype='banana'"):
        torch_dtype("banana")
    tokenizer = build_char_tokenizer()
    build_model("tiny-s", len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, _ = load_pretrained(tmp_path, "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_cpu_bf16_hardware_is_read_from_the_cpuinfo_flags():
    """model.dtype=bfloat16 on a CPU trainer warns where the CPU lacks bf16 products (runtime.executors.train)."""
    from areal_flow.dtypes import cpu_has_bf16

    amx = "processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512bw amx_bf16 amx_tile\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    zen4 = "flags\t\t: fpu avx2 avx512f avx512_bf16\n"
    skylake = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512vl\n"
    assert cpu_has_bf16(amx) is True and cpu_has_bf16(zen4) is True
    assert cpu_has_bf16(skylake) is False  # AVX-512 without BF16: emulated, slower than fp32
    assert cpu_has_bf16("Hardware\t: something without a flags line\n") is None  # nothing to judge by


def test_model_dtype_auto_is_bf16_only_where_the_device_multiplies_bf16():
    """model.dtype=auto: bf16 on a CPU with AVX-512 BF16 or AMX, fp32 on one without (bf16 emulated
    there) or where the flags cannot be read; an explicit dtype passes through; a bad one names the key."""
    from areal_flow.dtypes import model_dtype

    amx = "flags\t\t: fpu avx512f amx_bf16 amx_tile\n"
    icelake = "flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni\n"
    assert model_dtype("auto", "cpu", cpuinfo=amx) == "bfloat16"
    assert model_dtype("auto", "cpu", cpuinfo=icelake) == "float32"
    assert model_dtype("auto", "cpu", cpuinfo="no flags here\n") == "float32"
    assert model_dtype("bf16", "cpu", cpuinfo=icelake) == "bfloat16"  # the user's explicit choice stands
    assert model_dtype("FP32", "cuda") == "float32"
    with pytest.raises(ValueError, match="model.dtype='int4': expected auto or one of"):
        model_dtype("int4")
    # the instructions are not enough where the caller measures: bf16 products must be >= 1.3x fp32's
    assert model_dtype("auto", "cpu", cpuinfo=amx, bf16_speedup=lambda: 2.0) == "bfloat16"
    assert model_dtype("auto", "cpu", cpuinfo=amx, bf16_speedup=lambda: 1.3) == "bfloat16"
    assert model_dtype("auto", "cpu", cpuinfo=amx, bf16_speedup=lambda: 0.6) == "float32"  # the Xeon of 2026-12-08

    def never() -> float:
        raise AssertionError("timed where the flags already say no, or the user chose")

    assert model_dtype("auto", "cpu", cpuinfo=icelake, bf16_speedup=never) == "float32"
    assert model_dtype("bf16", "cpu", cpuinfo=amx, bf16_speedup=never) == "bfloat16"


@pytest.mark.parametrize("capability, chosen", [((7, 0), "float32"), ((7, 5), "float32"), ((8, 0), "bfloat16"),
                                                ((9, 0), "bfloat16")])
def test_model_dtype_auto_on_cuda_wants_compute_capability_8(monkeypatch, capability, chosen):
    """V100 (7.0) and T4 (7.5) hold bf16 tensors but emulate the products: auto keeps fp32 there;
    A100 (8.0) and H100 (9.0) multiply bf16 in hardware."""
    import torch

    from areal_flow.dtypes import model_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert model_dtype("auto", "cuda") == chosen


@pytest.mark.parametrize("has_bf16, speedup, chosen, hardware", [
    (True, 2.0, "bfloat16", "bf16 products in hardware"),
    (True, 0.61, "float32", "its bf16 products 0.61x fp32's, 1.3x needed"),
    (False, None, "float32", "none of avx512_bf16, amx_bf16 in /proc/cpuinfo")])
def test_the_trainer_resolves_model_dtype_auto_and_says_so(tmp_path, monkeypatch, capsys, has_bf16, speedup, chosen,
                                                          hardware):
    """A CPU trainer with model.dtype=auto autocasts in bf16 only where the CPU has bf16 products and
    they run faster than fp32's (timed), and prints its choice at start; an explicit bfloat16 on a
    CPU without them warns instead."""
    import torch

    import areal_flow.dtypes
    import runtime.engines.precision
    import runtime.executors.train
    from test_nonfinite import _train_executor

    for module in (areal_flow.dtypes, runtime.executors.train):
        monkeypatch.setattr(module, "cpu_has_bf16", lambda cpuinfo=None: has_bf16)
    for module in (runtime.engines.precision, runtime.executors.train):
        monkeypatch.setattr(module, "autocast_bf16_speedup", lambda: speedup)
    executor, _ = _train_executor(tmp_path, "model.dtype=auto")
    assert executor.ctx.dtype == getattr(torch, chosen)
    out = capsys.readouterr()
    assert f"train_step 'train_step': model.dtype=auto chose {chosen} on cpu ({hardware})" in out.out
    assert "areal-flow:" not in out.err
    executor, _ = _train_executor(tmp_path / "explicit", "model.dtype=bfloat16")
    assert executor.ctx.dtype == torch.bfloat16
    assert ("without bf16 hardware" in capsys.readouterr().err) is not has_bf16

    def never() -> float:
        raise AssertionError("timed for a dtype the user chose")

    for module in (runtime.engines.precision, runtime.executors.train):
        monkeypatch.setattr(module, "autocast_bf16_speedup", never)
    executor, _ = _train_executor(tmp_path / "fp32", "model.dtype=float32")
    assert executor.ctx.dtype == torch.float32
