// The elementwise parts of the embedded engine's decoder layer on CPU, each one pass over its
// rows in fp32 with one rounding to the input dtype at the end (PyTorch's eager versions make
// 3-8 dispatched ops of each, ~90 us a call at 32 rows whatever the size: docs/PERFORMANCE.md).
//
// Formulas (as runtime/engines/layer_ops.py, whose torch versions stay the reference):
//   add_rms_norm: h' = h + delta (rounded to the dtype, as the torch add), then
//                 weight * h' / sqrt(mean(h'^2) + eps), in fp32 (Zhang & Sennrich 2019, eq. 4;
//                 F.rms_norm's bf16 path computes in fp32 and rounds once too).
//   rope:         x * cos + flip_halves(x) * sin_signed on the half-split head layout (Su et al.
//                 2021, eq. 34, as transformers' rotate_half with sin's first half negated).
//   silu_mul:     silu(gate) * up = gate / (1 + exp(-gate)) * up (Shazeer 2020, eq. 6).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "vec16.h"

namespace {

using namespace areal_flow;

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, ": a contiguous CPU tensor expected");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what, ": fp32 or bf16 only; got ",
              t.scalar_type());
}

template <typename T>
void add_rms_norm_row(const T* h, const T* d, const T* w, T* out_h, T* out_x, int64_t n, float eps) {
  float ss = 0.f;
#ifdef AREAL_FLOW_AVX512
  const int64_t chunks = (n + 15) / 16;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask16 m = chunk_mask(c, n);
    store16(out_h + c * 16, _mm512_add_ps(load16(h + c * 16, m), load16(d + c * 16, m)), m);
    const __m512 x = load16(out_h + c * 16, m);  // the rounded sum, as the torch add leaves it
    acc = _mm512_fmadd_ps(x, x, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(ss / static_cast<float>(n) + eps));
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask16 m = chunk_mask(c, n);
    store16(out_x + c * 16, _mm512_mul_ps(_mm512_mul_ps(load16(out_h + c * 16, m), r), load16(w + c * 16, m)), m);
  }
#else
  for (int64_t e = 0; e < n; ++e) {
    out_h[e] = narrow<T>(widen(h[e]) + widen(d[e]));
    const float x = widen(out_h[e]);
    ss += x * x;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t e = 0; e < n; ++e) out_x[e] = narrow<T>(widen(out_h[e]) * r * widen(w[e]));
#endif
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  check_float(h, "add_rms_norm: h");
  check_float(delta, "add_rms_norm: delta");
  check_float(weight, "add_rms_norm: weight");
  TORCH_CHECK(h.sizes() == delta.sizes() && h.scalar_type() == delta.scalar_type() &&
                  weight.scalar_type() == h.scalar_type() && h.dim() >= 1 && weight.numel() == h.size(-1),
              "add_rms_norm: h ", h.sizes(), " and delta ", delta.sizes(), " of one dtype, weight [", h.size(-1),
              "] of it too; got weight ", weight.sizes());
  const int64_t n = h.size(-1), rows = h.numel() / std::max<int64_t>(n, 1);
  at::Tensor out_h = at::empty_like(h), out_x = at::empty_like(h);
  dispatch(h.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T *hp = h.data_ptr<T>(), *dp = delta.data_ptr<T>(), *wp = weight.data_ptr<T>();
    T *oh = out_h.data_ptr<T>(), *ox = out_x.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        add_rms_norm_row(hp + r * n, dp + r * n, wp, oh + r * n, ox + r * n, n, static_cast<float>(eps));
    });
  });
  return {out_h, out_x};
}

// q [rows, heads, T, hd] and k [rows, kv, T, hd] from qkv [rows, T, (heads + 2 kv) hd], rotated.
std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                        int64_t heads, int64_t kv) {
  check_float(qkv, "rope: qkv");
  check_float(cos, "rope: cos");
  check_float(sin, "rope: sin");
  TORCH_CHECK(qkv.dim() == 3 && heads > 0 && kv > 0 && qkv.size(2) % (heads + 2 * kv) == 0,
              "rope: qkv [rows, T, (heads + 2 kv) hd] expected; got ", qkv.sizes(), " for ", heads, " heads, ", kv,
              " kv heads");
  const int64_t rows = qkv.size(0), t_len = qkv.size(1), hd = qkv.size(2) / (heads + 2 * kv), half = hd / 2;
  TORCH_CHECK(hd % 2 == 0 && cos.sizes() == at::IntArrayRef({rows, t_len, hd}) && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rope: cos and sin [rows, T, hd] = [", rows, ", ", t_len, ", ", hd, "] of qkv's dtype; got ", cos.sizes(),
              " and ", sin.sizes());
  at::Tensor q = at::empty({rows, heads, t_len, hd}, qkv.options());
  at::Tensor k = at::empty({rows, kv, t_len, hd}, qkv.options());
  dispatch(qkv.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T *xp = qkv.data_ptr<T>(), *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
    T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>();
    const int64_t width = qkv.size(2), both = heads + kv;
    at::parallel_for(0, rows * t_len * both, 64, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t head = i % both, rt = i / both, r = rt / t_len, t = rt % t_len;
        const T* x = xp + rt * width + head * hd;
        const T *c = cp + rt * hd, *s = sp + rt * hd;
        T* o = head < heads ? qp + ((r * heads + head) * t_len + t) * hd : kp + ((r * kv + head - heads) * t_len + t) * hd;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float lo = widen(x[d]), hi = widen(x[d + half]);
          o[d] = narrow<T>(lo * widen(c[d]) + hi * widen(s[d]));
          o[d + half] = narrow<T>(hi * widen(c[d + half]) + lo * widen(s[d + half]));
        }
      }
    });
  });
  return {q, k};
}

// silu(gate) * up for gate_up [..., 2 I] (gate first) -> [..., I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float(gate_up, "silu_mul: gate_up");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: gate_up [..., 2 I] expected; got ",
              gate_up.sizes());
  const int64_t inter = gate_up.size(-1) / 2, rows = gate_up.numel() / std::max<int64_t>(2 * inter, 1);
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = inter;
  at::Tensor out = at::empty(shape, gate_up.options());
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T *g = gp + r * 2 * inter, *u = g + inter;
        T* o = op + r * inter;
#ifdef AREAL_FLOW_AVX512
        const __m512 one = _mm512_set1_ps(1.f);
        for (int64_t c = 0; c < (inter + 15) / 16; ++c) {
          const __mmask16 m = chunk_mask(c, inter);
          const __m512 x = load16(g + c * 16, m);
          const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
          store16(o + c * 16, _mm512_mul_ps(silu, load16(u + c * 16, m)), m);
        }
#else
        for (int64_t e2 = 0; e2 < inter; ++e2) {
          const float x = widen(g[e2]);
          o[e2] = narrow<T>(x / (1.f + std::exp(-x)) * widen(u[e2]));
        }
#endif
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(areal_flow, m) {
  m.def("add_rms_norm(Tensor h, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("rope", c10::DispatchKey::CPU, TORCH_FN(rope));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
}
