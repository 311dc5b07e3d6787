// The embedded engine's draw without top-p truncation on CPU: temperature, the two-level
// inverse-CDF draw and the behavior log-prob of runtime/engines/sampling.py (its ``sample`` stays
// the reference and serves top-p < 1), in two passes over each row's logits instead of ~15
// PyTorch ops over [rows, vocab] tensors.
//
// Per row, with x = logits / T (T = 1 for a greedy row, T = 0):
//   pass 1: max x and its first index (the greedy token);
//   pass 2: w_i = exp(x_i - max x), summed in blocks of 256 entries (the block masses) and in all;
//   draw:   the first block whose running mass exceeds u0 * total, then the first entry of that
//           block whose running sum of w exceeds u1 * its mass (inverse-CDF sampling, Devroye 1986,
//           ch. II.2, in two levels as sampling._draw), clamped to the last entry with w > 0;
//   log-prob: x_id - max x - log(total) (= log_softmax(x)[id]).
//
//   logits [rows, vocab] fp32, temps [rows] fp32 (0 = greedy), u [rows, 2] fp32 uniforms in [0, 1)
//   -> ids [rows] int64, logprobs [rows] fp32
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "vec16.h"

namespace {

using namespace areal_flow;

constexpr int64_t kBlock = 256;  // sampling._BLOCK

// sum of exp(x[i] * inv_t - top) over i in [0, n); also writes the terms to w when w is not null
float exp_sum(const float* x, int64_t n, float inv_t, float top, float* w) {
#ifdef AREAL_FLOW_AVX512
  __m512 acc = _mm512_setzero_ps();
  const __m512 vt = _mm512_set1_ps(inv_t), vtop = _mm512_set1_ps(top);
  for (int64_t c = 0; c < (n + 15) / 16; ++c) {
    const __mmask16 m = chunk_mask(c, n);
    const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_mul_ps(load16(x + c * 16, m), vt), vtop)));
    if (w != nullptr) store16(w + c * 16, e, m);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float e = std::exp(x[i] * inv_t - top);
    if (w != nullptr) w[i] = e;
    s += e;
  }
  return s;
#endif
}

// max of x[0 .. n) and the first index holding it
float row_max(const float* x, int64_t n, int64_t* at) {
#ifdef AREAL_FLOW_AVX512
  const int64_t chunks = (n + 15) / 16;
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t c = 0; c < chunks; ++c)
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), chunk_mask(c, n), x + c * 16));
  const float best = _mm512_reduce_max_ps(top);
  const __m512 vb = _mm512_set1_ps(best);
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask16 m = chunk_mask(c, n);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, x + c * 16), vb, _CMP_EQ_OQ);
    if (hit != 0) {
      *at = c * 16 + __builtin_ctz(hit);
      return best;
    }
  }
  *at = 0;  // no entry equals the max: every entry NaN
  return x[0];
#else
  float best = x[0];
  *at = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > best) best = x[i], *at = i;
  return best;
#endif
}

// index of the first running sum above target among v[0 .. n), clamped to the last positive entry
int64_t first_above(const float* v, int64_t n, float target) {
  float run = 0.f;
  int64_t last_positive = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (v[i] > 0.f) last_positive = i;
    run += v[i];
    if (run > target && v[i] > 0.f) return i;
  }
  return last_positive;
}

std::tuple<at::Tensor, at::Tensor> sample(const at::Tensor& logits, const at::Tensor& temps, const at::Tensor& u) {
  TORCH_CHECK(logits.device().is_cpu() && logits.is_contiguous() && logits.dim() == 2 &&
                  logits.scalar_type() == at::kFloat,
              "sample: logits [rows, vocab] contiguous fp32 on CPU expected; got ", logits.sizes(), " ",
              logits.scalar_type());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "sample: an empty vocabulary");
  const at::Tensor t = temps.to(at::kFloat).contiguous(), uu = u.to(at::kFloat).contiguous();
  TORCH_CHECK(t.numel() == rows && uu.numel() == 2 * rows, "sample: temps [rows] and u [rows, 2] expected; got ",
              temps.sizes(), " and ", u.sizes());
  at::Tensor ids = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor logps = at::empty({rows}, logits.options());
  const float *lp = logits.data_ptr<float>(), *tp = t.data_ptr<float>(), *up = uu.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* op = logps.data_ptr<float>();
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> mass(blocks), inner(kBlock);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * vocab;
      const bool greedy = tp[r] == 0.f;
      const float inv_t = greedy ? 1.f : 1.f / tp[r];
      int64_t best = 0;
      float top = row_max(x, vocab, &best);
      top *= inv_t;  // inv_t > 0: the maximum of x / T is max(x) / T, at the same index
      float total = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t len = std::min(kBlock, vocab - b * kBlock);
        mass[b] = exp_sum(x + b * kBlock, len, inv_t, top, nullptr);
        total += mass[b];
      }
      int64_t id = best;
      if (!greedy) {
        const int64_t b = first_above(mass.data(), blocks, up[2 * r] * total);
        const int64_t len = std::min(kBlock, vocab - b * kBlock);
        exp_sum(x + b * kBlock, len, inv_t, top, inner.data());
        id = b * kBlock + first_above(inner.data(), len, up[2 * r + 1] * mass[b]);
      }
      ip[r] = id;
      op[r] = x[id] * inv_t - top - std::log(total);
    }
  });
  return {ids, logps};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(areal_flow, m) {
  m.def("sample(Tensor logits, Tensor temps, Tensor u) -> (Tensor, Tensor)");
  m.impl("sample", c10::DispatchKey::CPU, TORCH_FN(sample));
}
