"""The embedded engine's fast path: preallocated KV cache, engine dtype (forced and
measured), weight repacking after updates, and the two-level inverse-CDF draw."""

import math
import os
import shutil
import types
from pathlib import Path

import pytest
import torch

from areal_flow.config import ConfigError, ExperimentConfig, GenerationConfig
from areal_flow.dtypes import cpu_has_bf16
from runtime.engines import precision
from runtime.engines.products import KernelWeight
from runtime.engines.generation import GenerationEngine
from runtime.engines.sampling import sample
from test_generation import TOK, _full_recompute_greedy, _model, _req

torch.set_num_threads(1)


def _dense(weight) -> torch.Tensor:
    """A packed weight in plain layout: oneDNN-blocked ones reordered back; the CPU kernels' ``[blocks,
    hidden/2, 16, 2]`` pairs (``products.KernelWeight``) put back in rows, those past ``out_features`` cut
    (a hidden dim not a multiple of 32 would keep its zero padding)."""
    if isinstance(weight, KernelWeight):
        blocks, pairs = weight.packed.shape[:2]
        rows = weight.packed.permute(0, 2, 1, 3).reshape(blocks * 16, pairs * 2)
        return rows[:weight.out_features]
    return weight.to_dense() if weight.is_mkldnn else weight


def test_kv_cache_is_allocated_once_per_response():
    engine = GenerationEngine(_model(0), TOK, max_batch_size=4)
    for i, p in enumerate(["7=", "12+5=", "305-47="]):
        engine.submit(_req(i, p, temperature=0.0, max_new_tokens=20))
    engine.step()  # prefill reserves room for prompt + 20 new tokens of every row
    ptrs = [k.data_ptr() for k in engine._dec.keys]
    for _ in range(18):
        engine.step()
    assert [k.data_ptr() for k in engine._dec.keys] == ptrs  # decode wrote in place, no reallocation


def test_forced_dtypes_and_bad_name():
    model = _model(0)
    assert precision.engine_dtype("bf16", "cpu", 8, model) is torch.bfloat16
    assert precision.engine_dtype("fp32", "cpu", 8, model) is torch.float32
    assert precision.engine_dtype(torch.float16, "cpu", 8, model) is torch.float16
    with pytest.raises(ValueError, match="gen.dtype='int8'"):
        precision.engine_dtype("int8", "cpu", 8, model)
    with pytest.raises(ConfigError, match="gen.dtype"):
        ExperimentConfig(gen=GenerationConfig(dtype="half-ish"))


@pytest.mark.parametrize("fp32_s, bf16_s, expected", [
    (1.0, 0.5, torch.bfloat16),  # 1.0 >= 1.3 * 0.5 = 0.65: bf16 pays
    (1.0, 0.9, torch.float32),  # 1.0 < 1.3 * 0.9 = 1.17: not enough, keep fp32
])
def test_auto_takes_bf16_only_when_measured_faster_and_caches(monkeypatch, fp32_s, bf16_s, expected):
    calls = []

    def fake(model, device, rows, dtypes, cpu_kernels):
        calls.append((dtypes, cpu_kernels))
        return [fp32_s, bf16_s]

    monkeypatch.setattr(precision, "_decode_step_seconds", fake)
    monkeypatch.setattr(precision, "_CHOICES", {})
    model = _model(0)
    assert precision.engine_dtype("auto", "cpu", 8, model) is expected
    assert precision.engine_dtype("auto", "cpu", 8, model) is expected
    assert calls == [((torch.float32, torch.bfloat16), "auto")]  # measured once per process and shape
    # the engine's gen.cpu_kernels is timed, and a different one is measured on its own
    assert precision.engine_dtype("auto", "cpu", 8, model, "off") is expected
    assert calls[1:] == [((torch.float32, torch.bfloat16), "off")]


def test_auto_measures_real_decode_steps():
    fp32_s, bf16_s = precision._decode_step_seconds(_model(0), "cpu", 4, (torch.float32, torch.bfloat16))
    assert 0 < fp32_s < 1 and 0 < bf16_s < 1


def test_the_autocast_check_times_both_products_once_per_thread_count(monkeypatch):
    """model.dtype=auto's timing (areal_flow.dtypes.model_dtype): best fp32 over best bf16 seconds of
    one product, after a warm-up round, measured once per thread count."""
    monkeypatch.setattr(precision, "_AUTOCAST_SPEEDUP", {})
    # the readings, fp32 then bf16 each round: the warm-up reads only its starts; then start/end pairs,
    # fp32 3 s and 4 s, bf16 1 s and 2 s: best 3 / best 1 = 3.0
    clock = iter([0.0, 0.0, 0.0, 3.0, 3.0, 4.0, 4.0, 8.0, 8.0, 10.0])
    monkeypatch.setattr(precision, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    assert precision.autocast_bf16_speedup(rows=4, size=8, rounds=2) == 3.0
    assert precision.autocast_bf16_speedup(rows=4, size=8, rounds=2) == 3.0  # cached: no clock left to read
    assert precision._AUTOCAST_SPEEDUP == {torch.get_num_threads(): 3.0}  # kept under this thread count


def test_bf16_engine_repacks_on_update_and_tags_versions():
    old, new = _model(3), _model(4)
    engine = GenerationEngine(_model(3), TOK, max_batch_size=2, dtype="bfloat16")
    attn = old.model.layers[0].self_attn
    want = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).bfloat16()
    assert torch.equal(_dense(engine._dec.layers[0].wqkv), want)
    engine.submit(_req(0, "12+5=", temperature=0.0, max_new_tokens=6))
    engine.step()
    engine.step()
    assert engine._dec.keys[0].dtype is torch.bfloat16
    engine.update_weights(new.state_dict(), version=2)
    attn = new.model.layers[0].self_attn
    want = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).bfloat16()
    assert torch.equal(_dense(engine._dec.layers[0].wqkv), want)
    results = []
    while engine.has_work():
        results += engine.step()
    assert results[0].versions == [0, 0, 2, 2, 2, 2]


def test_fp32_engine_matches_full_recompute_after_rows_move():
    """Rows finishing at different steps move the last live row into the hole; the moved
    sequences must continue exactly as a full recompute."""
    model = _model(7)
    engine = GenerationEngine(model, TOK, max_batch_size=4)
    lengths = [2, 9, 1, 9]  # rows 0 and 2 finish early; row 3 moves into a hole
    reqs = [_req(i, p, temperature=0.0, max_new_tokens=n) for i, (p, n) in enumerate(zip(["7=", "12+5=", "1-1=", "9+999="], lengths))]
    for r in engine.generate(reqs):
        assert r.output_ids == _full_recompute_greedy(model, r.prompt_ids, lengths[int(r.request_id[1:])])


def test_draw_follows_probabilities_across_blocks():
    # 600 entries = 3 blocks of 256 (the last padded): mass 0.5 at entry 3 (block 0),
    # 0.3 at entry 300 (block 1), 0.2 at entry 599 (block 2, just before the padding).
    vocab, n = 600, 20000
    logits = torch.full((n, vocab), -math.inf)
    logits[:, 3], logits[:, 300], logits[:, 599] = math.log(0.5), math.log(0.3), math.log(0.2)
    gen = torch.Generator().manual_seed(0)
    ids, logps = sample(logits, torch.ones(n), torch.ones(n), gen)
    assert set(ids.tolist()) <= {3, 300, 599}  # zero-probability entries are never drawn
    for idx, p in ((3, 0.5), (300, 0.3), (599, 0.2)):
        freq = (ids == idx).float().mean().item()
        assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / n)  # 5 binomial standard errors
        assert torch.allclose(logps[ids == idx], torch.tensor(math.log(p)), atol=1e-6)


def test_top_p_cut_tokens_are_never_drawn():
    # probs 0.5, 0.3, 0.2 with top_p = 0.7: keep 0.5 (mass before: 0) and 0.3 (before: 0.5 < 0.7),
    # drop 0.2 (before: 0.8 >= 0.7); kept ones renormalised to 0.5/0.8 = 0.625 and 0.375.
    n = 20000
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2])).repeat(n, 1)
    ids, logps = sample(logits, torch.ones(n), torch.full((n,), 0.7), torch.Generator().manual_seed(1))
    assert (ids != 2).all()
    freq = (ids == 0).float().mean().item()
    assert abs(freq - 0.625) < 5 * math.sqrt(0.625 * 0.375 / n)
    assert torch.allclose(logps[ids == 1], torch.tensor(math.log(0.3)), atol=1e-6)  # untruncated log-prob


def test_each_replica_says_which_dtype_auto_chose_and_warns_for_a_coupled_loss(monkeypatch, capsys, tmp_path):
    from types import SimpleNamespace

    from runtime.workers import engine_precision
    from test_resume import _plan

    monkeypatch.setattr(precision, "_decode_step_seconds", lambda model, device, rows, dtypes, cpu_kernels: [1.0, 0.4])
    monkeypatch.setattr(precision, "_CHOICES", {})
    engine = GenerationEngine(_model(0), TOK, max_batch_size=4, dtype="auto")  # 1.0 / 0.4 = 2.5x >= 1.3x: bf16
    gen = SimpleNamespace(engine=engine, node=SimpleNamespace(name="generate"))
    spec = SimpleNamespace(rank=1, plan=_plan(tmp_path, "train.loss.use_decoupled_loss=false"))  # a coupled loss
    assert engine_precision(spec, gen) == {"engine_dtype": "bfloat16", "engine_dtype_speedup": 2.5}
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == ("generate 'generate' replica 1: gen.dtype=auto chose bfloat16 (bfloat16 decode step 2.50x as "
                        "fast as float32; 1.3x needed)")
    assert len(lines) == 2 and "warning: the engine decodes in bfloat16 while train.loss.use_decoupled_loss" in lines[1]
    spec.plan = _plan(tmp_path)  # k = 2 (the yaml): the compiler turns the decoupled loss on
    engine_precision(spec, gen)
    assert "warning" not in capsys.readouterr().err  # the trainer's proximal log-probs are the reference
    forced = SimpleNamespace(engine=GenerationEngine(_model(0), TOK, max_batch_size=4), node=gen.node)
    assert engine_precision(spec, forced) == {"engine_dtype": "float32"} and capsys.readouterr().err == ""


def _head_only_model():
    """tiny-s whose layers add nothing to the residual stream (every projection and bias 0:
    attention outputs softmax(.) @ 0, the MLP silu(0) * 0), with embedding and LM head rounded
    to bf16 (so the engine's bf16 copy is exact) and a final-norm weight of 1/8 (logits within
    about +-8: sampled tokens are not all near-certain, whose log-prob would round to 0 anyway)."""
    model = _model(5)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and "norm" not in name:
                p.zero_()
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=gen).bfloat16())
        model.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight.bfloat16())
        model.model.norm.weight.fill_(0.125)
    return model


def _behavior_vs_recompute(model, **engine_kw) -> torch.Tensor:
    """``|behavior - fp32 recompute|`` over every sampled token (T = 1) of the engine ``engine_kw``."""
    from areal_flow.models.logprobs import token_logprobs

    engine = GenerationEngine(model, TOK, max_batch_size=8, seed=0, **engine_kw)
    results = engine.generate([_req(i, p, max_new_tokens=8) for i, p in enumerate(["7=", "12+5=", "305-47=", "1-1="])])
    diffs = []
    for r in results:
        ids = torch.tensor([r.prompt_ids + r.output_ids])
        with torch.no_grad():
            ref = token_logprobs(model, ids, torch.ones_like(ids))[0, len(r.prompt_ids):]
        diffs.append(torch.tensor(r.behavior_logprobs) - ref)
    return torch.cat(diffs).abs()


def test_fp32_lm_head_adds_no_bf16_error_to_the_logits():
    # The layers add 0 and the embedding is bf16-exact, so the last residual is the same in the
    # bf16 engine and in fp32: the only difference left is where the final norm and LM head run.
    # fp32 head: the same fp32 products as the recompute (sums in another order): fp32's 6e-8
    # relative error x |logit| <= 8 x 64 terms ~ 3e-5, below 1e-4 nats. bf16 head: the normed
    # input and the logits are rounded to bf16 (8 bits: a logit in [4, 8) to a multiple of 1/32,
    # off by up to 1/64), and log-softmax passes a logit error e on as up to 2e: ~1e-2 nats.
    model = _head_only_model()
    fp32_head = _behavior_vs_recompute(model, dtype="bfloat16", head_dtype="float32")
    bf16_head = _behavior_vs_recompute(model, dtype="bfloat16", head_dtype="engine")
    assert fp32_head.max() < 1e-4
    assert bf16_head.max() > 1e-3  # the setting does exercise the rounding the fp32 head removes


def test_lm_head_dtype_names_are_checked():
    with pytest.raises(ValueError, match="gen.lm_head_dtype='int8': expected auto or engine or mixed or one of"):
        GenerationEngine(_model(0), TOK, max_batch_size=2, dtype="bfloat16", head_dtype="int8")
    with pytest.raises(ConfigError, match="gen.lm_head_dtype"):
        ExperimentConfig(gen=GenerationConfig(lm_head_dtype="half-ish"))
    engine = GenerationEngine(_model(0), TOK, max_batch_size=2, dtype="bfloat16", head_dtype="engine")
    assert engine.head_dtype is torch.bfloat16 and _dense(engine._dec.head).dtype is torch.bfloat16
    assert GenerationEngine(_model(0), TOK, max_batch_size=2, dtype="bf16").head_dtype is torch.float32
    # auto (the default): the mixed head for a bf16 engine where its kernel runs (a CPU with AMX's
    # bf16 tiles or AVX-512 BF16, and a C++ compiler to build it), never for an fp32 one
    runs = bool(cpu_has_bf16()) and shutil.which(os.environ.get("CXX", "c++")) is not None
    assert GenerationEngine(_model(0), TOK, max_batch_size=2, dtype="bf16")._dec.mixed_head == runs
    assert not GenerationEngine(_model(0), TOK, max_batch_size=2, dtype="float32")._dec.mixed_head


def test_weights_travel_in_the_16_bit_engine_dtype_or_a_16_bit_trainers_or_the_one_auto_chose():
    from areal_flow.dtypes import weights_dtype

    assert weights_dtype("bf16", "float32") == "bfloat16"  # the engine casts to bf16 on load anyway
    assert weights_dtype("float16", "bfloat16") == "float16"
    assert weights_dtype("float32", "bfloat16") == "float32"  # an fp32 engine gets fp32
    assert weights_dtype("auto", "bf16") == "bfloat16"
    assert weights_dtype("auto", "float32") == "engine"  # known once the engine has chosen: it announces it
    assert weights_dtype("auto", "bf16", device="cuda") == "engine"  # auto picks fp16 (or fp32) there
    assert weights_dtype("auto", "float16", device="cuda") == "float16"
    assert weights_dtype("bfloat16", "float32", engine="vllm") == "float32"  # vLLM runs in model.dtype
    assert weights_dtype("float32", "bfloat16", engine="vllm") == "bfloat16"
    # model.dtype=auto is resolved on each worker's device: only the engine knows before the first version
    assert weights_dtype("auto", "auto") == "engine" and weights_dtype("auto", "auto", engine="vllm") == "engine"
    assert weights_dtype("bfloat16", "auto") == "bfloat16"  # an explicit 16-bit engine decides alone


@pytest.mark.parametrize("overrides, attribute, expected", [
    ([], "float32", torch.float32),  # the main job: fp32 engine, fp32 trainer
    (["gen.dtype=bfloat16"], "bfloat16", torch.bfloat16),
    (["gen.dtype=auto", "model.dtype=bfloat16"], "bfloat16", torch.bfloat16),
    (["gen.dtype=auto"], "engine", None),  # each tensor's own until the engine announces its choice
])
def test_the_plan_names_the_weights_dtype_and_the_trainer_publishes_in_it(overrides, attribute, expected):
    from areal_flow.cli import load_flow
    from areal_flow.config_load import load_config
    from compiler.program import compile_program
    from runtime.workers import wire_dtype

    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "graphs/arith_grpo.yaml", ["eval.enabled=false", *overrides])
    plan = compile_program(load_flow(repo / "graphs/arith_grpo.py")(cfg), cfg)
    sync = next(n for n in plan.nodes if n.op == "sync_weights")
    assert sync.attrs["weights_dtype"] == attribute
    assert wire_dtype(plan, "train_step") is expected


def test_an_auto_engine_gets_the_weight_matrices_in_the_dtype_it_chose(tmp_path):
    """``gen.dtype=auto`` with an fp32 trainer: the plan says ``engine``, the replica announces what it chose,
    and every version's bytes are the policy's with its matrices in that dtype (counted by hand below)."""
    import json

    from runtime.model_source import load_pretrained
    from tests.runs import REPO, cli_run

    cli_run(REPO / "graphs/arith_grpo.py", "train.steps=3", "gen.dtype=auto", "eval.enabled=false",
            f"out_dir={tmp_path}", "name=auto")
    out = tmp_path / "auto"
    chosen = json.loads((out / "summary.json").read_text())["workers"]["generate/0"]["engine_dtype"]
    sent = [s["weights/bytes"] for s in map(json.loads, (out / "steps.jsonl").read_text().splitlines())
            if "weights/bytes" in s]
    state = load_pretrained(out / "model")[0].state_dict()
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    expected, seen = 0, set()
    for name, t in state.items():
        if t.data_ptr() in seen:  # a tied tensor travels once
            continue
        seen.add(t.data_ptr())
        matrix = t.dim() >= 2 and t.data_ptr() != head.data_ptr()  # the LM head (the tied embedding) stays fp32
        nbytes = t.numel() * (2 if matrix and chosen in ("bfloat16", "float16") else 4)
        expected += -(-nbytes // 64) * 64  # each tensor on a 64-byte boundary
    assert chosen in ("bfloat16", "float32") and sent == [expected, expected]


def test_a_plan_may_spell_engine_in_any_case_as_the_plan_check_accepts_it():
    """A hand-edited ``"weights_dtype": "ENGINE"`` passes ``plan_check`` (case-insensitive), so the runtime
    must read it alike: each tensor's own dtype until an engine announces one, not a ValueError."""
    from areal_flow.cli import load_flow
    from areal_flow.config_load import load_config
    from compiler.program import compile_program
    from runtime.workers import wire_dtype

    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "graphs/arith_grpo.yaml", ["eval.enabled=false", "gen.dtype=auto"])
    plan = compile_program(load_flow(repo / "graphs/arith_grpo.py")(cfg), cfg)
    next(n for n in plan.nodes if n.op == "sync_weights").attrs["weights_dtype"] = "ENGINE"
    assert wire_dtype(plan, "train_step") is None
