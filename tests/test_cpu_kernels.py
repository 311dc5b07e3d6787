"""The fused CPU kernels (runtime/engines/csrc): decode attention against the formula
softmax(q k^T * scale) v (Vaswani et al. 2017, eq. 1) computed here in float64, the layer kernels
against layer_ops' PyTorch versions and hand-computed values, their errors, and the decoder's
choice (``gen.cpu_kernels``)."""

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_flow.config import ConfigError, ExperimentConfig, GenerationConfig
from runtime.engines import cpu_kernels, layer_ops
from runtime.engines.decoder import KVDecoder
from runtime.engines.generation import GenerationEngine
from runtime.engines.sampling import sample
from test_generation import PROMPTS, TOK, _model, _req

torch.set_num_threads(1)


def _kernels():
    """The CPU kernels; the test is skipped where the machine has no C++ compiler (the engine then runs
    PyTorch's ops, ``gen.cpu_kernels=auto``). With a compiler, a failed build fails the test."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the engine runs PyTorch's ops (gen.cpu_kernels=auto)")
    return cpu_kernels.load()


def _reference(q, keys, values, lens, scale, cache_rows=None, prefix_rows=None, prefix_lens=None):
    """The formula row by row in float64: row r, KV head j, query i attends to positions 0 .. lens[r] of
    cache row ``cache_rows[r]`` (default r), positions below ``prefix_lens[r]`` taken from cache row
    ``prefix_rows[r]`` instead."""
    rows, kv, g, hd = q.shape
    out = torch.zeros(rows, kv, g, hd, dtype=torch.float64)
    for r in range(rows):
        n, c = int(lens[r]) + 1, r if cache_rows is None else int(cache_rows[r])
        m, pre = (0, c) if prefix_rows is None else (int(prefix_lens[r]), int(prefix_rows[r]))
        for j in range(kv):
            k = torch.cat([keys[pre, j, :m], keys[c, j, m:n]]).double()
            v = torch.cat([values[pre, j, :m], values[c, j, m:n]]).double()
            weights = torch.softmax(q[r, j].double() @ k.T * scale, dim=-1)  # [g, n]
            out[r, j] = weights @ v
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2 ** -8)])
@pytest.mark.parametrize("kv, g, hd", [(3, 3, 64), (2, 1, 8), (1, 4, 24), (2, 2, 72), (1, 2, 264)])
def test_kernel_equals_the_formula(dtype, tol, kv, g, hd):
    # hd 8 / 24 / 72: partial 16-lane chunks; 264 > 256: the portable loop; g = 1: no grouping
    op = _kernels().decode_attention
    gen = torch.Generator().manual_seed(hd * 10 + g)
    rows, cap = 5, 40
    keys = torch.randn(rows + 2, kv, cap, hd, generator=gen).to(dtype)  # more cache rows than queries
    values = torch.randn(rows + 2, kv, cap, hd, generator=gen).to(dtype)
    q = torch.randn(rows, kv, g, hd, generator=gen).to(dtype)
    lens = torch.tensor([0, 1, 17, 39, 16])  # one key only; the whole capacity; 16 / 17 keys (block edges)
    scale = 1 / math.sqrt(hd)
    got = op(q, keys, values, lens, scale)
    want = _reference(q, keys, values, lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    # bf16: the fp32 result rounded once, so relative error <= 2^-9 of each output's size (+ tiny sums)
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol)
    # a prefill's layout: rows reading other cache rows, two the same one up to different positions
    cache_rows = torch.tensor([6, 0, 3, 3, 1])
    got = op(q, keys, values, lens, scale, cache_rows)
    assert torch.allclose(got.double(), _reference(q, keys, values, lens, scale, cache_rows), rtol=tol, atol=tol)
    # a decode step whose rows read their first positions from other rows (here rows of other contents:
    # the formula over the spliced keys); none, one, a block edge (16), the whole length but its last
    prefix_rows, prefix_lens = torch.tensor([2, 6, 3, 5, 3]), torch.tensor([0, 1, 16, 39, 9])
    got = op(q, keys, values, lens, scale, None, None, None, prefix_rows, prefix_lens)
    want = _reference(q, keys, values, lens, scale, None, prefix_rows, prefix_lens)
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol)
    assert not torch.allclose(got.double(), _reference(q, keys, values, lens, scale), rtol=tol, atol=tol)
    # where the other row holds a copy of those positions, the same bits as reading its own
    for r, (src, n) in enumerate(zip(prefix_rows.tolist(), prefix_lens.tolist())):
        if src >= rows:  # a row without a query of its own: may take the copy
            keys[src, :, :n], values[src, :, :n] = keys[r, :, :n], values[r, :, :n]
    mine = torch.tensor([src if src >= rows else r for r, src in enumerate(prefix_rows.tolist())])
    copied = op(q, keys, values, lens, scale, None, None, None, mine, prefix_lens)
    assert torch.equal(copied, op(q, keys, values, lens, scale))



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_steps_new_keys_and_values_are_written_at_each_rows_length(dtype):
    op = _kernels().decode_attention
    gen = torch.Generator().manual_seed(3)
    rows, kv, g, hd, cap = 4, 3, 3, 64, 20
    keys = torch.randn(rows + 1, kv, cap, hd, generator=gen).to(dtype)
    values = torch.randn(rows + 1, kv, cap, hd, generator=gen).to(dtype)
    q = torch.randn(rows, kv, g, hd, generator=gen).to(dtype)
    lens = torch.tensor([0, 7, 19, 3])
    new_k = torch.randn(rows, kv, hd, generator=gen).to(dtype)  # contiguous, as the rope kernel's keys
    new_v = torch.randn(kv, rows, 2 * hd, generator=gen).to(dtype)[..., hd:].transpose(0, 1)  # other strides
    assert new_v.stride() != new_k.stride() and new_v.stride(2) == 1
    want_k, want_v = keys.clone(), values.clone()
    for r in range(rows):
        want_k[r, :, int(lens[r])] = new_k[r]
        want_v[r, :, int(lens[r])] = new_v[r]
    got = op(q, keys, values, lens, 1 / 8, None, new_k, new_v)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)  # only those positions changed
    assert torch.equal(got, op(q, want_k, want_v, lens, 1 / 8))  # then attends as over that cache
    with pytest.raises(RuntimeError, match="new_keys and new_values come together"):
        op(q, keys, values, lens, 1 / 8, None, new_k)
    with pytest.raises(RuntimeError, match="new_keys and new_values come together"):
        op(q, keys, values, lens, 1 / 8, torch.arange(rows), new_k, new_v)
    for bad_k in (new_k[:, :2], new_k.transpose(1, 2).contiguous().transpose(1, 2), new_k.half()):
        with pytest.raises(RuntimeError, match=r"new_keys and new_values \[rows, kv, hd\] = \[4, 3, 64\]"):
            op(q, keys, values, lens, 1 / 8, None, bad_k, new_v)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)  # a refused call wrote nothing
    # the engine's call: this step's keys written and rows reading their first positions from another row. Row 0
    # holds no position before its new key (length 0), so row 1 may not read 5 from it; refused before any write
    other_k, other_v = torch.randn_like(new_k.float()).to(dtype), torch.randn_like(new_k.float()).to(dtype)
    with pytest.raises(RuntimeError, match="row 1 reads 5 positions from row 0, which holds 0 before"):
        op(q, keys, values, lens, 1 / 8, None, other_k, other_v, torch.tensor([0, 0, 2, 3]), torch.tensor([0, 5, 0, 0]))
    with pytest.raises(RuntimeError, match=r"prefix_rows and prefix_lens \[rows\] int64"):
        op(q, keys, values, lens, 1 / 8, None, other_k, other_v, torch.tensor([0, 2, 2, 2], dtype=torch.int32),
           torch.tensor([0, 5, 0, 3]))
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)  # other keys refused: not written
    src, n = torch.tensor([0, 2, 2, 2]), torch.tensor([0, 5, 0, 3])
    got = op(q, keys, values, lens, 1 / 8, None, new_k, new_v, src, n)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)  # the same writes at each row's length
    assert torch.allclose(got.double(), _reference(q, want_k, want_v, lens, 1 / 8, None, src, n), rtol=2 ** -8,
                          atol=2 ** -8)


def test_one_key_returns_its_value_and_equal_scores_average():
    op = _kernels().decode_attention
    keys = torch.zeros(1, 1, 4, 2)
    values = torch.tensor([[[[1.0, 2.0], [3.0, 4.0], [5.0, 9.0], [7.0, 7.0]]]])
    q = torch.tensor([[[[1.0, -1.0]]]])
    # length 0: position 0 only -> its value (1, 2); length 2: three equal scores (keys 0) -> mean of
    # the first three values ((1+3+5)/3, (2+4+9)/3) = (3, 5)
    assert torch.equal(op(q, keys, values, torch.tensor([0]), 1.0), torch.tensor([[[[1.0, 2.0]]]]))
    assert torch.allclose(op(q, keys, values, torch.tensor([2]), 1.0), torch.tensor([[[[3.0, 5.0]]]]))


def test_kernel_errors_name_the_culprit():
    op = _kernels().decode_attention
    cache = torch.zeros(2, 1, 8, 4)
    q = torch.zeros(2, 1, 1, 4)
    with pytest.raises(RuntimeError, match="row 1's length 8 is outside 0 .. 7"):
        op(q, cache, cache, torch.tensor([3, 8]), 1.0)
    with pytest.raises(RuntimeError, match="fp32 or bf16 only"):
        op(q.half(), cache.half(), cache.half(), torch.tensor([3, 3]), 1.0)
    with pytest.raises(RuntimeError, match="does not match q"):
        op(torch.zeros(2, 1, 1, 5), cache, cache, torch.tensor([3, 3]), 1.0)
    with pytest.raises(RuntimeError, match="row 0 reads cache row 2, outside 0 .. 1"):
        op(q, cache, cache, torch.tensor([3, 3]), 1.0, torch.tensor([2, 0]))
    both = torch.tensor([3, 3])
    with pytest.raises(RuntimeError, match="prefix_rows and prefix_lens come together"):
        op(q, cache, cache, both, 1.0, None, None, None, torch.tensor([1, 0]))
    with pytest.raises(RuntimeError, match="row 1 reads its prefix from cache row 2, outside 0 .. 1"):
        op(q, cache, cache, both, 1.0, None, None, None, torch.tensor([1, 2]), torch.tensor([1, 1]))
    with pytest.raises(RuntimeError, match="row 0's prefix of 4 positions is outside 0 .. 3"):
        op(q, cache, cache, both, 1.0, None, None, None, torch.tensor([1, 0]), torch.tensor([4, 0]))


def test_add_rms_norm_kernel_equals_hand_computed_and_torch():
    ops = layer_ops.FusedOps(_kernels())
    # h (1, 2) + delta (2, 2) = (3, 4); mean square (9 + 16) / 2 = 12.5; weight (1, 2)
    h, x = ops.add_rms_norm(torch.tensor([[1.0, 2.0]]), torch.tensor([[2.0, 2.0]]), torch.tensor([1.0, 2.0]), 0.0)
    assert torch.equal(h, torch.tensor([[3.0, 4.0]]))
    assert torch.allclose(x, torch.tensor([[3.0, 8.0]]) / math.sqrt(12.5), rtol=1e-6)
    gen = torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)):
        h, d = (torch.randn(3, 5, 40, generator=gen).to(dtype) for _ in range(2))  # 40: a partial 16-lane chunk
        w = (1 + 0.1 * torch.randn(40, generator=gen)).to(dtype)
        (h1, x1), (h2, x2) = ops.add_rms_norm(h, d, w, 1e-5), layer_ops.add_rms_norm(h, d, w, 1e-5)
        assert torch.equal(h1, h2)  # one fp32 add rounded once, in both
        assert torch.allclose(x1.float(), x2.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -6)])
@pytest.mark.parametrize("hd", [8, 64])
def test_rope_kernel_equals_layer_ops(dtype, tol, hd):
    ops = layer_ops.FusedOps(_kernels())
    gen = torch.Generator().manual_seed(hd)
    rows, t, heads, kv = 2, 3, 4, 2
    qkv = torch.randn(rows, t, (heads + 2 * kv) * hd, generator=gen).to(dtype)
    angle = torch.rand(rows, t, hd // 2, generator=gen) * 6
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(dtype)[:, None]
    sin = torch.cat((-angle.sin(), angle.sin()), -1).to(dtype)[:, None]  # first half negated, as the decoder passes
    got, want = ops.rope_split(qkv, cos, sin, heads, kv, None, None, 0.0), layer_ops.rope_split(
        qkv, cos, sin, heads, kv, None, None, 0.0)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
    # hand-computed: one head of hd 2 at angle pi / 2 rotates (x0, x1) to (-x1, x0)
    one = torch.tensor([[[1.0, 2.0, 5.0, 6.0, 7.0, 8.0]]])  # q (1, 2), k (5, 6), v (7, 8)
    q, k, v = ops.rope_split(one, torch.zeros(1, 1, 1, 2), torch.tensor([[[[-1.0, 1.0]]]]), 1, 1, None, None, 0.0)
    assert q.flatten().tolist() == [-2.0, 1.0] and k.flatten().tolist() == [-6.0, 5.0]
    assert v.flatten().tolist() == [7.0, 8.0]


def test_silu_mul_kernel_equals_hand_computed_and_torch():
    ops = layer_ops.FusedOps(_kernels())
    # silu(0) = 0; silu(ln 3) = ln 3 * sigmoid(ln 3) = ln 3 * 3 / 4; times up (5, 2)
    got = ops.silu_mul(torch.tensor([[0.0, math.log(3), 5.0, 2.0]]))
    assert torch.allclose(got, torch.tensor([[0.0, 1.5 * math.log(3)]]), rtol=1e-6, atol=1e-7)
    gen = torch.Generator().manual_seed(2)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)):
        gate_up = (3 * torch.randn(2, 3, 2 * 20, generator=gen)).to(dtype)  # 20: a partial chunk
        assert torch.allclose(ops.silu_mul(gate_up).float(), layer_ops.silu_mul(gate_up).float(), rtol=tol, atol=tol)


def test_engine_with_kernel_generates_what_sdpa_generates():
    # fp32: the same greedy responses and behavior log-probs to float noise
    _kernels()
    model = _model(3)
    runs = {}
    for mode in ("on", "off"):  # 5 prompts on 4 rows: a finished row is refilled mid-run
        engine = GenerationEngine(model, TOK, max_batch_size=4, cpu_kernels=mode)
        assert (engine._dec.kernels is None) == (mode == "off")
        runs[mode] = engine.generate([_req(i, p, temperature=0.0, max_new_tokens=12 + i)
                                      for i, p in enumerate(PROMPTS)])
    for a, b in zip(runs["on"], runs["off"]):
        assert a.output_ids == b.output_ids and len(a.output_ids) > 10
        assert max(abs(x - y) for x, y in zip(a.behavior_logprobs, b.behavior_logprobs)) < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_read_their_copied_prompt_from_its_source_row_and_draw_the_same_bits(dtype, monkeypatch):
    """Groups sharing a prompt and a system turn, admitted over several steps (rows finish and free
    their slots, so some sources die before the rows that copied from them), a weight update
    midway: decode reading each row's copied beginning from its source row draws the same tokens
    and the same log-probs, bit for bit, as each row reading its own copy."""
    _kernels()
    from runtime.engines import generation, prefill_plan

    system = "1234567890" * 4
    prompts = [system + t for t in ("12+5=", "3-1=")] + ["305-47="]
    reqs = [_req(i, prompts[i % 3], temperature=1.0, max_new_tokens=3 + (5 * i) % 7) for i in range(14)]
    seen = {"shared_steps": 0, "orphans": 0}

    def spy(rows):
        live = {id(seq) for seq in rows}
        seen["orphans"] += sum(seq.prefix is not None and id(seq.prefix[0]) not in live for seq in rows)
        out = prefill_plan.prefix_rows(rows)
        seen["shared_steps"] += out is not None
        return out

    runs = {}
    for mode in ("shared", "own"):
        monkeypatch.setattr(generation, "prefix_rows", spy if mode == "shared" else (lambda rows: None))
        engine = GenerationEngine(_model(11), TOK, max_batch_size=6, seed=5, dtype=dtype, cpu_kernels="on")
        for r in reqs:
            engine.submit(r)
        results = [res for _ in range(4) for res in engine.step()]
        engine.update_weights(_model(12).state_dict(), version=1)
        while engine.has_work():
            results += engine.step()
        runs[mode] = sorted(results, key=lambda r: r.request_id)
    assert seen["shared_steps"] >= 8 and seen["orphans"] > 0  # reads shared, and some sources did finish first
    assert len(runs["shared"]) == len(reqs)
    for a, b in zip(runs["shared"], runs["own"]):
        assert a.output_ids == b.output_ids and a.behavior_logprobs == b.behavior_logprobs and a.versions == b.versions


def _teacher_forced_logits(dec: KVDecoder, steps: int = 8) -> torch.Tensor:
    """Log-softmax of every decode step's logits ``[steps, rows, vocab]`` for the prompts, each then
    fed the same fixed tokens (no sampling, so two decoders see the same inputs)."""
    seqs = [TOK.encode(p) for p in PROMPTS]
    fed = torch.randint(3, len(TOK), (steps, len(seqs)), generator=torch.Generator().manual_seed(0))
    dec.reserve(len(seqs), max(map(len, seqs)) + steps + 1)
    dec.prefill(seqs, list(range(len(seqs))))
    lengths = torch.tensor([len(s) for s in seqs])
    out = []
    for t in range(steps):
        out.append(torch.log_softmax(dec.decode(fed[t], lengths + t), dim=-1))
    return torch.stack(out)


def test_bf16_kernel_is_as_close_to_fp32_as_sdpa_is():
    # bf16 rounds differently in each path, so compare each with the fp32 decoder on the same tokens:
    # the kernel keeps scores and sums in fp32, SDPA's bf16 CPU path rounds the probabilities too
    _kernels()
    model = _model(3)
    exact = _teacher_forced_logits(KVDecoder(model, torch.float32, 8, cpu_kernels="off"))
    err = {mode: (_teacher_forced_logits(KVDecoder(model, torch.bfloat16, 8, torch.float32, mode)) - exact).abs()
           for mode in ("on", "off")}
    assert err["off"].max() > 1e-3  # the bf16 rounding is really there
    assert err["on"].mean() <= 1.1 * err["off"].mean()
    assert err["on"].max() <= 1.5 * err["off"].max()


def test_kernel_mode_where_it_cannot_run_is_a_clear_error(monkeypatch):
    model = _model(0)
    with pytest.raises(ValueError, match="gen.cpu_kernels=on: .*CPU in float32 or bfloat16"):
        KVDecoder(model, torch.float16, 4, cpu_kernels="on")
    assert KVDecoder(model, torch.float16, 4).kernels is None  # auto: PyTorch's ops, quietly (a dtype, not a failure)
    monkeypatch.setattr(cpu_kernels, "_loaded", {"error": "building the CPU kernels failed: no compiler"})
    with pytest.raises(ValueError, match="gen.cpu_kernels=on: building the CPU kernels failed: no compiler"):
        KVDecoder(model, torch.float32, 4, cpu_kernels="on")
    dec = KVDecoder(model, torch.bfloat16, 4)  # auto falls back to PyTorch's ops
    assert dec.kernels is None and dec.ops is layer_ops


def test_auto_runs_the_kernels_for_bf16_and_fp32_and_off_keeps_pytorch_ops():
    _kernels()
    model = _model(0)
    assert KVDecoder(model, torch.bfloat16, 4).kernels is not None
    assert KVDecoder(model, torch.float32, 4).kernels is not None
    assert KVDecoder(model, torch.float32, 4, cpu_kernels="off").kernels is None


def test_config_rejects_an_unknown_cpu_kernels_value():
    with pytest.raises(ConfigError, match="gen.cpu_kernels='yes': expected one of auto, on, off"):
        ExperimentConfig(gen=GenerationConfig(cpu_kernels="yes"))


@pytest.mark.parametrize("given, meant", [("on", "on"), ("off", "off"), ("auto", "auto")])
def test_cpu_kernels_on_and_off_survive_yaml_booleans(tmp_path, given, meant):
    """YAML 1.1 reads a bare on / off as true / false; the command line and a yaml file both mean the word."""
    from areal_flow.config_load import load_config

    assert load_config(None, [f"gen.cpu_kernels={given}"]).gen.cpu_kernels == meant
    path = tmp_path / "run.yaml"
    path.write_text(f"gen:\n  cpu_kernels: {given}\n")
    assert load_config(path, []).gen.cpu_kernels == meant


def test_sample_kernel_draws_the_torch_path_tokens_and_log_probs():
    kernels = _kernels()
    gen = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(400, 700, generator=gen)  # 700: three 256-entry blocks, the last partial
    temps = torch.tensor([0.0, 0.5, 1.0, 2.0]).repeat(100)
    top_p = torch.ones(400)
    a, b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    ids_k, lp_k = sample(logits, temps, top_p, a, kernels)
    ids_t, lp_t = sample(logits, temps, top_p, b)
    assert torch.equal(a.get_state(), b.get_state())  # the same uniforms taken from the generator
    assert (ids_k == ids_t).float().mean() > 0.99  # only a uniform within rounding of a boundary may differ
    greedy = temps == 0
    assert torch.equal(ids_k[greedy], logits[greedy].argmax(-1))
    # the behavior log-prob: log_softmax(logits / T)[id], T = 1 for greedy rows (float64 here)
    scaled = logits.double() / torch.where(greedy, 1.0, temps).double()[:, None]
    want = torch.log_softmax(scaled, -1).gather(-1, ids_k[:, None]).squeeze(-1)
    assert torch.allclose(lp_k.double(), want, atol=2e-5)


def test_sample_kernel_follows_the_softmax_and_never_draws_a_zero_probability_token():
    kernels = _kernels()
    # probabilities 0.1, 0.2, 0.3, 0.4 at T = 1 on entries 0, 300, 520, 699; every other entry -inf
    logits = torch.full((1, 700), float("-inf"))
    logits[0, [0, 300, 520, 699]] = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    n = 20000
    u = torch.rand(n, 2, generator=torch.Generator().manual_seed(3))
    ids, logps = kernels.sample(logits.expand(n, 700).contiguous(), torch.ones(n), u)
    counts = torch.bincount(ids, minlength=700)
    assert counts.sum() == counts[[0, 300, 520, 699]].sum()
    freq = counts[[0, 300, 520, 699]].double() / n
    # atol 0.015: >= 4 standard errors of each frequency (sqrt(0.4 * 0.6 / 20000) = 0.0035 at most)
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), atol=0.015)
    assert torch.allclose(logps, logits[0, ids], atol=1e-6)
    # uniforms at the top of [0, 1): the last positive entry, never the -inf padding after it
    top = kernels.sample(logits, torch.ones(1), torch.tensor([[0.9999999, 0.9999999]]))[0]
    assert int(top) == 699


def _checks_built_for(march: str, tmp_path, checks: str | None, test_file: Path = Path(__file__)
                      ) -> tuple[dict, subprocess.CompletedProcess]:
    """``test_file``'s tests selected by ``-k checks`` (None: all; slow ones left out), in a process of their own
    whose kernels are built with ``-march=march`` (one build of the ops a process); returns that process's
    environment and its finished pytest run, which must have passed."""
    _kernels()
    env = {**os.environ, cpu_kernels.MARCH_ENV: march, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    select = [] if checks is None else ["-k", checks]
    done = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", str(test_file), "-m",
                           "not slow", *select], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return env, done


@pytest.mark.slow
def test_portable_paths_without_avx512_pass_the_same_checks(tmp_path):
    # a build for x86-64-v3 (AVX2, no AVX-512) compiles the kernels' plain C++ loops; checked against this
    # file's formula and hand-computed checks
    env, _ = _checks_built_for("x86-64-v3", tmp_path, "formula or hand_computed or sample_kernel or one_key or errors_name")
    lanes = subprocess.run([sys.executable, "-c", "from runtime.engines import cpu_kernels; "
                            "print(cpu_kernels.load().simd_lanes())"], env=env, capture_output=True, text=True,
                           timeout=120, cwd=Path(__file__).parents[1])
    assert lanes.stdout.split() == ["1"], lanes.stderr[-2000:]  # the plain loops, not the AVX-512 paths


@pytest.mark.slow
def test_the_avx512_bf16_head_passes_the_mixed_head_checks_where_the_cpu_has_it(tmp_path):
    # a CPU with AMX builds the AMX head natively; a build for Cooper Lake (AVX-512 BF16, no AMX) compiles the
    # VDPBF16PS product instead (the native one on AMD Zen 4 / 5), checked in its own process by every test of
    # test_mixed_product.py (float64 products, rounding bounds, the engine's error) as the native build is
    cpu = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if "avx512_bf16" not in cpu:
        pytest.skip("the CPU has no AVX-512 BF16: a Cooper Lake build would not run here")
    _, done = _checks_built_for("cooperlake", tmp_path, None, Path(__file__).with_name("test_mixed_product.py"))
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-3000:]
