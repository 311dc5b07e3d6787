"""The CPU kernels' mixed bf16 product (runtime/engines/csrc/lm_head.cpp): bf16 inputs and weights, fp32 sums.
As the LM head (fp32 logits) against the float64 product of its bf16 inputs and PyTorch's bf16 rounding; as a
bf16 engine's layer products (bias in fp32, one rounding to bf16) against oneDNN's and in the engine's error
against an fp32 decoder."""

import pytest
import torch

from runtime.engines import products
from runtime.engines.decoder import KVDecoder
from runtime.engines.generation import GenerationEngine
from test_cpu_kernels import _kernels, _teacher_forced_logits
from test_generation import TOK, _model

torch.set_num_threads(1)


def _mixed_head_or_skip():
    kernels = _kernels()
    try:
        kernels.lm_head(torch.zeros(1, 32), kernels.pack_lm_head(torch.zeros(16, 32, dtype=torch.bfloat16)), 16)
    except RuntimeError as e:
        pytest.skip(f"no mixed LM head on this CPU (neither AMX nor AVX-512 BF16): {e}")
    return kernels


@pytest.mark.parametrize("rows, vocab, hidden", [(1, 16, 32), (17, 70, 40), (64, 1000, 64), (80, 333, 96),
                                                (13, 50, 40), (23, 98, 64), (6, 90, 40)])
def test_mixed_head_equals_the_exact_product_of_its_bf16_inputs(rows, vocab, hidden):
    # partial row tiles (17, 80; AMX's are 16 rows), every row remainder after the AVX-512 BF16 path's blocks of
    # 4 rows (13, 6, 23), vocabularies not a multiple of 16 whose last block is partial in a full group of 6 blocks
    # (90), in a shorter last group (50, 70, 333, 1000) or alone (98), hidden dims padded to 32
    kernels = _mixed_head_or_skip()
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(vocab, hidden, generator=gen).bfloat16()
    x = torch.randn(rows, hidden, generator=gen)
    got = kernels.lm_head(x, kernels.pack_lm_head(w), vocab)
    want = x.bfloat16().double() @ w.double().T  # bf16 products are exact; only the fp32 sums round
    assert got.dtype == torch.float32 and got.shape == (rows, vocab)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, n_out, hidden", [(1, 16, 32), (13, 90, 40), (6, 200, 64), (23, 50, 64)])
def test_mixed_head_kernel_adds_the_bias_in_fp32_and_rounds_once_to_bf16(rows, n_out, hidden):
    # the same product as the head's plus a bias: the fp32 output is the float64 sum of the bf16 products and
    # the bias to fp32 precision, and the bf16 output (a layer's, bf16_out) is exactly that fp32 output rounded
    # once to nearest even (Tensor.bfloat16); every remainder after blocks of 4 rows (13, 6, 23), partial last
    # blocks (90, 50 columns) and a padded hidden (40)
    kernels = _mixed_head_or_skip()
    gen = torch.Generator().manual_seed(hidden)
    w = torch.randn(n_out, hidden, generator=gen).bfloat16()
    x = torch.randn(rows, hidden, generator=gen).bfloat16()
    bias = torch.randn(n_out, generator=gen).bfloat16()
    packed = kernels.pack_lm_head(w)
    fp32 = kernels.lm_head(x, packed, n_out, bias)
    bf16 = kernels.lm_head(x, packed, n_out, bias, True)
    want = x.double() @ w.double().T + bias.double()
    assert torch.allclose(fp32.double(), want, rtol=1e-5, atol=1e-5)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, fp32.bfloat16())


def test_kernel_packed_layer_product_matches_onednn_to_one_bf16_rounding():
    # where the kernels run the mixed product on AVX-512 BF16, a bf16 engine's layer weights are packed for it
    # (products.KernelWeight); both it and oneDNN's packed bf16 product sum exact bf16 products in fp32 and round
    # once, so they differ by at most one bf16 step (2^-7 relative) of each output, plus the fp32 sums' order
    kernels = _mixed_head_or_skip()
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    x = torch.randn(2, 5, 64, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    packed = products.pack_weight(w, 8, kernels)
    assert isinstance(packed, products.KernelWeight)
    got = products.linear(x, packed, bias)
    ref = products.linear(x, products.pack_weight(w, 8), bias)
    exact = x.double() @ w.double().T + bias.double()
    assert got.shape == (2, 5, 96) and got.dtype == torch.bfloat16
    assert ((got.double() - ref.double()).abs() <= exact.abs() * 2 ** -7 + 1e-6).all()


def test_bf16_engine_with_kernel_products_is_as_close_to_fp32_as_with_onednns():
    kernels = _mixed_head_or_skip()
    if kernels.mixed_product_isa() != "avx512_bf16":
        pytest.skip(f"the kernels run the mixed product on {kernels.mixed_product_isa()}: oneDNN's products stay")
    model = _model(3)  # Qwen2: biases on q, k and v
    exact = _teacher_forced_logits(KVDecoder(model, torch.float32, 8, cpu_kernels="off"))
    err = {}
    for by_kernel in (True, False):
        dec = KVDecoder(model, torch.bfloat16, 8, torch.float32, "on")
        assert dec.kernel_products and isinstance(dec.layers[0].wqkv, products.KernelWeight)
        if not by_kernel:
            dec.kernel_products = False
            dec.pack()
            assert dec.layers[0].wqkv.is_mkldnn
        err[by_kernel] = (_teacher_forced_logits(dec) - exact).abs()
    assert err[False].max() > 1e-3  # the bf16 rounding is really there
    assert err[True].mean() <= 1.1 * err[False].mean()
    assert err[True].max() <= 1.5 * err[False].max()


def test_mixed_head_removes_the_bf16_rounding_of_large_logits():
    # LM logits are large because hidden states align with their tokens' rows: w_n = noise + s_n x
    # gives logits ~ s_n |x|^2 (~30 here). A bf16 product rounds each to 8 bits (error up to
    # 2^-9 * 30 ~ 0.06); the mixed head rounds only x and w, whose errors in the sum are ~sqrt(576)
    # products of size ~0.05 * 2^-9 each, ~20x smaller.
    kernels = _mixed_head_or_skip()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 576, generator=gen)
    w = 0.05 * torch.randn(2000, 576, generator=gen) + 0.05 * torch.randn(2000, 1, generator=gen) * x[:1]
    exact = x.double() @ w.double().T
    err_mixed = (kernels.lm_head(x, kernels.pack_lm_head(w.bfloat16()), 2000).double() - exact).abs().max()
    err_bf16 = (torch.nn.functional.linear(x.bfloat16(), w.bfloat16()).double() - exact).abs().max()
    assert exact[0].abs().max() > 20 and err_bf16 > 0.03
    assert err_mixed < err_bf16 / 3


def test_engine_with_mixed_head_matches_the_fp32_head():
    _mixed_head_or_skip()
    model = _model(4)
    logps = {}
    for head in ("float32", "mixed"):
        dec = GenerationEngine(model, TOK, max_batch_size=8, dtype="bfloat16", head_dtype=head)._dec
        assert dec.mixed_head == (head == "mixed")
        logps[head] = _teacher_forced_logits(dec)
    assert (logps["mixed"] - logps["float32"]).abs().max() < 0.1  # bf16 rounding of the head's inputs only


def test_mixed_head_without_the_kernels_runs_the_fp32_head(caplog):
    model = _model(0)
    with caplog.at_level("WARNING"):
        dec = KVDecoder(model, torch.bfloat16, 4, torch.float32, cpu_kernels="off", mixed_head=True)
    assert not dec.mixed_head and dec.head_dtype == torch.float32
    assert "gen.lm_head_dtype=mixed: the mixed head cannot run here" in caplog.text


def test_mixed_product_on_two_threads_equals_one_bit_for_bit():
    # the work is split over column groups x 64-row chunks: 150 rows are three chunks, 200 columns three groups
    # (the last partial); each output is one task's, summed in the same order whatever the thread count
    kernels = _mixed_head_or_skip()
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(200, 64, generator=gen).bfloat16()
    x = torch.randn(150, 64, generator=gen).bfloat16()
    packed = kernels.pack_lm_head(w)
    one = kernels.lm_head(x, packed, 200, None, True)
    torch.set_num_threads(2)
    try:
        two = kernels.lm_head(x, packed, 200, None, True)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two)
    assert torch.allclose(one.double(), x.double() @ w.double().T, rtol=2 ** -7, atol=1e-5)
