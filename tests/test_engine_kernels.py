"""The embedded engine's kernel paths against their reference formulas: oneDNN-packed
products, residual add + RMSNorm, the rotary split, causal-only prefill and the one-pass
behavior log-prob."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from runtime.engines import layer_ops
from runtime.engines.decoder import KVDecoder
from runtime.engines.products import linear, pack_weight
from runtime.engines.sampling import sample
from test_generation import PROMPTS, TOK, _model

torch.set_num_threads(1)


def _packs(dtype: torch.dtype) -> bool:
    """Whether this machine's torch can hold a ``dtype`` weight in oneDNN's blocked layout."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_product_equals_hand_computed(dtype):
    # W rows (1, 2), (3, 4), (5, 6); x rows (1, 1) and (2, -1):
    # x @ W.T = [[1+2, 3+4, 5+6], [2-2, 6-4, 10-6]] = [[3, 7, 11], [0, 2, 4]] (exact in bf16 too)
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=dtype)
    packed = pack_weight(w, rows=4)
    assert packed.is_mkldnn == _packs(dtype)
    x = torch.tensor([[1.0, 1.0], [2.0, -1.0]], dtype=dtype)
    assert torch.equal(linear(x, packed, None).float(), torch.tensor([[3.0, 7.0, 11.0], [0.0, 2.0, 4.0]]))
    # one row in a [rows, T, in] input, bias (1, 0, -1): [3+1, 7+0, 11-1]
    bias = torch.tensor([1.0, 0.0, -1.0], dtype=dtype)
    assert torch.equal(linear(x[:1, None], packed, bias).float(), torch.tensor([[[4.0, 7.0, 10.0]]]))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("rows", [1, 5, 48])
def test_packed_product_equals_f_linear(dtype, tol, rows):
    """bf16: the same oneDNN kernel as ``F.linear``, bit-identical; fp32: oneDNN instead of
    MKL, the same sums in another order (relative difference at fp32 rounding)."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen).to(dtype)
    x = torch.randn(rows, 3, 64, generator=gen).to(dtype)
    ref = F.linear(x, w)
    got = linear(x, pack_weight(w, rows=8), None)
    assert got.shape == ref.shape == (rows, 3, 96) and got.dtype == dtype
    assert ((got.double() - ref.double()).abs() <= tol * ref.double().abs().max()).all()


def test_add_rms_norm_equals_hand_computed():
    # h + delta = (1+2, 2+2) = (3, 4); mean square (9 + 16) / 2 = 12.5, sqrt 3.5355339;
    # times weight (1, 0.5): (3 / 3.5355339, 0.5 * 4 / 3.5355339) = (0.8485281, 0.5656854)
    h, delta = torch.tensor([[[1.0, 2.0]]]), torch.tensor([[[2.0, 2.0]]])
    summed, normed = layer_ops.add_rms_norm(h, delta, torch.tensor([1.0, 0.5]), 0.0)
    assert torch.equal(summed, torch.tensor([[[3.0, 4.0]]]))
    assert torch.allclose(normed, torch.tensor([[[0.8485281, 0.5656854]]]), atol=1e-6)


def test_rope_split_equals_transformers_rotary():
    rows, t, nh, nkv, hd = 2, 3, 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(rows, t, (nh + 2 * nkv) * hd, generator=gen)
    angle = torch.rand(rows, t, hd // 2, generator=gen) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)  # [rows, T, hd], HF layout
    q_ref = qkv[..., :nh * hd].view(rows, t, nh, hd).transpose(1, 2)
    k_ref = qkv[..., nh * hd:(nh + nkv) * hd].view(rows, t, nkv, hd).transpose(1, 2)
    q_ref, k_ref = apply_rotary_pos_emb(q_ref, k_ref, cos, sin)
    signed = torch.cat((-sin[..., :hd // 2], sin[..., hd // 2:]), -1)  # as the decoder passes it
    q, k, v = layer_ops.rope_split(qkv, cos.unsqueeze(1), signed.unsqueeze(1), nh, nkv, None, None, 0.0)
    assert torch.allclose(q, q_ref, atol=1e-6) and torch.allclose(k, k_ref, atol=1e-6)
    assert torch.equal(v, qkv[..., (nh + nkv) * hd:].view(rows, t, nkv, hd).transpose(1, 2))


def test_causal_prefill_of_padded_rows_equals_each_prompt_alone():
    """Right-padded rows of 2..7 tokens prefilled together with a causal mask only: each row's
    last logits and cached keys/values equal a prefill of that prompt alone (no padding)."""
    model = _model(5)
    seqs = [TOK.encode(p) for p in PROMPTS]
    together = KVDecoder(model, torch.float32, len(seqs))
    together.reserve(len(seqs), 16)
    with torch.inference_mode():
        logits = together.prefill(seqs, list(range(len(seqs))))
        for r, s in enumerate(seqs):
            alone = KVDecoder(model, torch.float32, 1)
            alone.reserve(1, 16)
            assert torch.allclose(logits[r], alone.prefill([s], [0])[0], atol=1e-5)
            for cache, ref in ((together.keys, alone.keys), (together.values, alone.values)):
                assert torch.allclose(cache[0][r, :, :len(s)], ref[0][0, :, :len(s)], atol=1e-5)
                assert torch.allclose(cache[-1][r, :, :len(s)], ref[-1][0, :, :len(s)], atol=1e-5)


@pytest.mark.parametrize("kernels", ["off", "auto"])
def test_prefill_after_a_copied_prefix_equals_the_whole_sequence_alone(kernels):
    """Rows that continue a prompt copied from another row (``copy_rows``, then ``prefill`` from a
    cached start), in rows past the first, over a cache of garbage, with prompts of 3..8 tokens and
    0..9 tokens after them (0: the prompt's last token fed again): their logits, and the decode step
    after, equal each whole sequence prefilled alone."""
    model = _model(5)
    prompts = [TOK.encode(p) for p in ("7=", "305-47=", "9+999=")]
    which = [0, 1, 1, 2, 0]  # each row's prompt
    tails = [[4, 5, 6, 7, 8], [], [9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [5, 6]]  # its tokens after it
    seqs = [prompts[w] + t for w, t in zip(which, tails)]
    starts = [len(prompts[w]) - (0 if t else 1) for w, t in zip(which, tails)]
    rows = [2, 3, 4, 5, 6]
    dec = KVDecoder(model, torch.float32, 8, cpu_kernels=kernels)
    dec.reserve(8, 32)
    gen = torch.Generator().manual_seed(0)
    for c in dec.keys + dec.values:
        c.copy_(torch.randn(c.shape, generator=gen))
    fed = torch.tensor([3, 4, 5, 6, 7, 8, 9])  # one more token for rows 0 .. 6
    with torch.inference_mode():
        dec.prefill(prompts, [0, 1, 7])  # the prompts in rows 0, 1 and 7
        dec.copy_rows([[0, 1, 7][w] for w in which], rows, max(map(len, prompts)))
        got = dec.prefill([s[st:] for s, st in zip(seqs, starts)], rows, starts)
        lengths = torch.tensor([len(p) for p in prompts[:2]] + [len(s) for s in seqs])
        step = dec.decode(fed, lengths)
        for i, s in enumerate(seqs):
            alone = KVDecoder(model, torch.float32, 1, cpu_kernels=kernels)
            alone.reserve(1, 32)
            assert torch.allclose(got[i], alone.prefill([s], [0])[0], atol=1e-5), i
            assert torch.allclose(step[rows[i]], alone.decode(fed[rows[i]:rows[i] + 1], torch.tensor([len(s)]))[0],
                                  atol=1e-5), i
        # a wrong start (the tail placed as if nothing were cached) is caught by the same comparison
        bad = dec.prefill([seqs[0][starts[0]:]], [2], [0])
        assert not torch.allclose(bad[0], got[0], atol=1e-3)


def test_behavior_logprob_equals_log_softmax_and_greedy_takes_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen) * 4
    temps = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.7, 0.0])
    ids, logps = sample(logits, temps, torch.ones(6), gen)
    scaled = logits.double() / torch.where(temps == 0, 1.0, temps).double()[:, None]  # greedy rows at T = 1
    ref = torch.log_softmax(scaled, -1).gather(-1, ids[:, None]).squeeze(-1)
    assert (logps.double() - ref).abs().max() < 1e-6
    assert ids[2] == logits[2].argmax() and ids[5] == logits[5].argmax()
