// Attention for the embedded engine on CPU: every (row, KV head) pair's g grouped query heads against
// that head's first len+1 cached keys and values, in one call: a decode step's rows, or a prefill's
// (sequence, position) pairs each reading its sequence's cache row (cache_rows).
//
// Why a kernel: a decode step's attention is rows x kv_heads tiny problems (SmolLM2-135M at 32
// rows: 96 problems a layer, each a 3-query x ~80-key product); ATen's SDPA and batched matmul
// pay ~5 us a problem in set-up whatever the path (docs/PERFORMANCE.md). Here each problem is a
// few hundred fp32 vector operations with no allocation.
//
// Numerics: scores, softmax and the weighted sum in fp32 (the bf16 inputs widened exactly);
// softmax as exp(s - max) / sum (Vaswani et al. 2017, eq. 1, with the usual max shift). The
// output is rounded once to the input dtype.
//
// Layouts (all contiguous):
//   q      [rows, kv_heads, g, hd]     the grouped queries (query head j*g + i is (j, i))
//   keys   [cap_rows, kv_heads, cap, hd]  the decoder's cache; row r's positions 0 .. lens[r]
//   values [cap_rows, kv_heads, cap, hd]
//   lens   [rows] int64: row r attends to cache positions 0 .. lens[r] (inclusive)
//   cache_rows [rows] int64, optional: the cache row each row reads (default: row r reads row r). A
//          prefill passes one row per (sequence, position), each reading its sequence's cache row up to
//          its own position: causal attention as rows x positions decode-shaped problems.
//   new_keys, new_values [rows, kv_heads, hd], optional, any row and head strides, not overlapping the
//          cache: a decode step's own key and value, written into cache row r at position lens[r] before
//          the attention reads it (a 128-byte copy each; torch's index_copy_ took ~29 us a layer for 64
//          rows). Every check runs before this write, so a refused call leaves the cache as it was.
//   prefix_rows, prefix_lens [rows] int64, optional, together: row r reads its cache positions
//          0 .. prefix_lens[r] - 1 from cache row prefix_rows[r] instead of its own, which holds a copy of
//          them (a GRPO group's prompt, prefilled once and copied to its rows: prefill_plan.py). The rows
//          of a group then read one copy of their common beginning, which stays in the core's caches
//          across them, instead of a copy each from memory (cascade attention's saving, without its
//          second softmax pass: Juravsky et al. 2024, "Hydragen", sec. 3, split the same way). The result
//          is the same bits when the two copies are the same bits.
//   out    [rows, kv_heads, g, hd]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "vec16.h"

namespace {

using namespace areal_flow;

// Where a problem's keys and values lie: positions t < npre in the prefix row's head (kpre, vpre),
// the rest in its own (k, v); every row hd elements.
template <typename T>
struct Span {
  const T *kpre, *vpre, *k, *v;
  int64_t npre, hd;
  const T* key(int64_t t) const { return (t < npre ? kpre : k) + t * hd; }
  const T* value(int64_t t) const { return (t < npre ? vpre : v) + t * hd; }
};

// One (row, KV head) problem: n keys, g queries, head dim hd. s is scratch of g * n floats.
template <typename T>
void problem_portable(const T* qp, const Span<T>& kv, T* op, int64_t n, int64_t g, int64_t hd, float scale,
                      float* s) {
  std::vector<float> qf(g * hd), acc(g * hd, 0.f);
  for (int64_t e = 0; e < g * hd; ++e) qf[e] = widen(qp[e]) * scale;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < g; ++i) {
      const T* kt = kv.key(t);
      float dot = 0.f;
      for (int64_t d = 0; d < hd; ++d) dot += qf[i * hd + d] * widen(kt[d]);
      s[i * n + t] = dot;
    }
  for (int64_t i = 0; i < g; ++i) {
    float* si = s + i * n;
    const float top = *std::max_element(si, si + n);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) sum += (si[t] = std::exp(si[t] - top));
    for (int64_t t = 0; t < n; ++t) si[t] /= sum;
  }
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < g; ++i)
      for (int64_t d = 0; d < hd; ++d) acc[i * hd + d] += s[i * n + t] * widen(kv.value(t)[d]);
  for (int64_t e = 0; e < g * hd; ++e) op[e] = narrow<T>(acc[e]);
}

#ifdef AREAL_FLOW_AVX512
constexpr int kMaxChunks = 16;  // head_dim <= 256
constexpr int kMaxGroup = 16;   // query heads per KV head

constexpr int64_t kAhead = 8;  // rows prefetched ahead of use

template <typename T>
inline void prefetch_row(const T* p, int64_t hd) {
  for (int64_t b = 0; b < hd * static_cast<int64_t>(sizeof(T)); b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T0);
}

template <typename T>
void problem_avx512(const T* qp, const Span<T>& kv, T* op, int64_t n, int64_t g, int64_t hd, float scale,
                    float* s) {
  const int64_t chunks = (hd + 15) / 16;
  __m512 q[kMaxGroup][kMaxChunks], acc[kMaxGroup][kMaxChunks];
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < g; ++i)
    for (int64_t c = 0; c < chunks; ++c) {
      q[i][c] = _mm512_mul_ps(load16(qp + i * hd + c * 16, chunk_mask(c, hd)), vs);
      acc[i][c] = _mm512_setzero_ps();
    }
  for (int64_t t = 0; t < n; ++t) {  // scores: one key row loaded once for the g queries
    prefetch_row(kv.key(std::min(t + kAhead, n - 1)), hd);  // the cache streams from memory: ~1.5x with these
    prefetch_row(kv.value(t), hd);
    const T* kt = kv.key(t);
    __m512 k[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) k[c] = load16(kt + c * 16, chunk_mask(c, hd));
    for (int64_t i = 0; i < g; ++i) {
      __m512 dot = _mm512_mul_ps(q[i][0], k[0]);
      for (int64_t c = 1; c < chunks; ++c) dot = _mm512_fmadd_ps(q[i][c], k[c], dot);
      s[i * n + t] = _mm512_reduce_add_ps(dot);
    }
  }
  const int64_t blocks = (n + 15) / 16;
  for (int64_t i = 0; i < g; ++i) {  // softmax of each query's n scores
    float* si = s + i * n;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t b = 0; b < blocks; ++b)
      top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), chunk_mask(b, n), si + b * 16));
    const __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const __mmask16 m = chunk_mask(b, n);
      const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, si + b * 16);
      const __m512 e = exp16(_mm512_sub_ps(x, vtop));
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
      _mm512_mask_storeu_ps(si + b * 16, m, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
    for (int64_t b = 0; b < blocks; ++b) {
      const __mmask16 m = chunk_mask(b, n);
      _mm512_mask_storeu_ps(si + b * 16, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, si + b * 16), inv));
    }
  }
  for (int64_t t = 0; t < n; ++t) {  // weighted sum of the value rows
    prefetch_row(kv.value(std::min(t + kAhead, n - 1)), hd);
    const T* vt = kv.value(t);
    __m512 v[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) v[c] = load16(vt + c * 16, chunk_mask(c, hd));
    for (int64_t i = 0; i < g; ++i) {
      const __m512 w = _mm512_set1_ps(s[i * n + t]);
      for (int64_t c = 0; c < chunks; ++c) acc[i][c] = _mm512_fmadd_ps(w, v[c], acc[i][c]);
    }
  }
  for (int64_t i = 0; i < g; ++i)
    for (int64_t c = 0; c < chunks; ++c) store16(op + i * hd + c * 16, acc[i][c], chunk_mask(c, hd));
}
#endif

// The optional per-row index arrays of a call (nullptr: absent).
struct RowMaps {
  const int64_t* cache_rows;   // the cache row each row reads (default: its own)
  const int64_t* prefix_rows;  // the row its first prefix_lens[r] positions are read from
  const int64_t* prefix_lens;
};

template <typename T>
void attend(const T* q, const T* keys, const T* values, const int64_t* lens, const RowMaps& maps, T* out,
            int64_t rows, int64_t kv, int64_t g, int64_t cap, int64_t hd, float scale) {
  // problem p = (row p / kv, head p % kv): the first key of its head in its cache row
  const auto first_key = [&](int64_t p) {
    const int64_t row = p / kv, head = p % kv;
    return ((maps.cache_rows == nullptr ? row : maps.cache_rows[row]) * kv + head) * cap * hd;
  };
  const auto span = [&](int64_t p) {
    const int64_t own = first_key(p);
    if (maps.prefix_rows == nullptr) return Span<T>{keys + own, values + own, keys + own, values + own, 0, hd};
    const int64_t pre = (maps.prefix_rows[p / kv] * kv + p % kv) * cap * hd;
    return Span<T>{keys + pre, values + pre, keys + own, values + own, maps.prefix_lens[p / kv], hd};
  };
#ifdef AREAL_FLOW_AVX512
  const bool wide = hd <= 16 * kMaxChunks && g <= kMaxGroup;
#else
  const bool wide = false;
#endif
  at::parallel_for(0, rows * kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = lens[p / kv] + 1;
      s.resize(g * n);
      const T* qp = q + p * g * hd;
      const Span<T> at = span(p);
      T* op = out + p * g * hd;
#ifdef AREAL_FLOW_AVX512
      if (wide) {
        if (p + 1 < end) {  // the next problem's first keys, whose lines the loop's own prefetch does not reach
          const Span<T> next = span(p + 1);
          for (int64_t t = 0; t < std::min<int64_t>(kAhead, lens[(p + 1) / kv] + 1); ++t) prefetch_row(next.key(t), hd);
        }
        problem_avx512(qp, at, op, n, g, hd, scale, s.data());
        continue;
      }
#endif
      problem_portable(qp, at, op, n, g, hd, scale, s.data());
    }
  });
}

// new_keys / new_values of a decode step into cache row r, position lens[r] (checked by the caller).
void write_new(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& new_keys,
               const at::Tensor& new_values, const int64_t* lens) {
  const int64_t rows = new_keys.size(0), kv = new_keys.size(1), hd = new_keys.size(2), cap = keys.size(2);
  const size_t bytes = static_cast<size_t>(hd) * keys.element_size();
  auto* kc = static_cast<char*>(keys.data_ptr());
  auto* vc = static_cast<char*>(values.data_ptr());
  const auto* nk = static_cast<const char*>(new_keys.data_ptr());
  const auto* nv = static_cast<const char*>(new_values.data_ptr());
  const int64_t es = keys.element_size();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < kv; ++j) {
      const int64_t at = ((r * kv + j) * cap + lens[r]) * hd * es;
      std::memcpy(kc + at, nk + (r * new_keys.stride(0) + j * new_keys.stride(1)) * es, bytes);
      std::memcpy(vc + at, nv + (r * new_values.stride(0) + j * new_values.stride(1)) * es, bytes);
    }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& lens, double scale, const c10::optional<at::Tensor>& cache_rows,
                            const c10::optional<at::Tensor>& new_keys, const c10::optional<at::Tensor>& new_values,
                            const c10::optional<at::Tensor>& prefix_rows, const c10::optional<at::Tensor>& prefix_lens) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "decode_attention: q [rows, kv, g, hd], keys/values [cap_rows, kv, cap, hd]; got q ",
              q.sizes(), ", keys ", keys.sizes(), ", values ", values.sizes());
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous(),
              "decode_attention: q, keys and values must be contiguous");
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(),
              "decode_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "decode_attention: fp32 or bf16 only; got ", q.scalar_type());
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "decode_attention: q, keys and values must share a dtype");
  const int64_t rows = q.size(0), kv = q.size(1), g = q.size(2), hd = q.size(3), cap = keys.size(2);
  TORCH_CHECK(keys.size(1) == kv && keys.size(3) == hd && (cache_rows.has_value() || keys.size(0) >= rows),
              "decode_attention: cache ", keys.sizes(), " does not match q ", q.sizes());
  at::Tensor rc;
  if (cache_rows.has_value()) {
    TORCH_CHECK(cache_rows->scalar_type() == at::kLong && cache_rows->numel() == rows && cache_rows->device().is_cpu(),
                "decode_attention: cache_rows [rows] int64 on CPU");
    rc = cache_rows->contiguous();
    const int64_t* rp = rc.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(rp[r] >= 0 && rp[r] < keys.size(0), "decode_attention: row ", r, " reads cache row ", rp[r],
                  ", outside 0 .. ", keys.size(0) - 1);
  }
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.numel() == rows, "decode_attention: lens [rows] int64");
  const at::Tensor lc = lens.contiguous();
  const int64_t* lp = lc.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lp[r] >= 0 && lp[r] < cap, "decode_attention: row ", r, "'s length ", lp[r], " is outside 0 .. ",
                cap - 1, " (the cache's capacity)");
  }
  at::Tensor pr, pl;
  if (prefix_rows.has_value() || prefix_lens.has_value()) {
    TORCH_CHECK(prefix_rows.has_value() && prefix_lens.has_value(), "decode_attention: prefix_rows and prefix_lens "
                "come together");
    for (const at::Tensor& t : {*prefix_rows, *prefix_lens})
      TORCH_CHECK(t.scalar_type() == at::kLong && t.numel() == rows && t.device().is_cpu(),
                  "decode_attention: prefix_rows and prefix_lens [rows] int64 on CPU; got ", t.sizes(), " ",
                  t.scalar_type());
    pr = prefix_rows->contiguous();
    pl = prefix_lens->contiguous();
    const int64_t *rp = pr.data_ptr<int64_t>(), *np = pl.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(rp[r] >= 0 && rp[r] < keys.size(0), "decode_attention: row ", r, " reads its prefix from cache row ",
                  rp[r], ", outside 0 .. ", keys.size(0) - 1);
      TORCH_CHECK(np[r] >= 0 && np[r] <= lp[r], "decode_attention: row ", r, "'s prefix of ", np[r],
                  " positions is outside 0 .. ", lp[r], " (its length: its own key at position ", lp[r],
                  " is never read from another row)");
      TORCH_CHECK(cache_rows.has_value() || rp[r] >= rows || np[r] <= lp[rp[r]], "decode_attention: row ", r,
                  " reads ", np[r], " positions from row ", rp[r], ", which holds ", lp[rp[r]],
                  " before this step's key");
    }
  }
  if (new_keys.has_value() || new_values.has_value()) {
    TORCH_CHECK(new_keys.has_value() && new_values.has_value() && !cache_rows.has_value(),
                "decode_attention: new_keys and new_values come together, in a decode step (no cache_rows)");
    for (const at::Tensor& t : {*new_keys, *new_values})
      TORCH_CHECK(t.dim() == 3 && t.size(0) == rows && t.size(1) == kv && t.size(2) == hd && t.stride(2) == 1 &&
                      t.scalar_type() == keys.scalar_type() && t.device().is_cpu(),
                  "decode_attention: new_keys and new_values [rows, kv, hd] = [", rows, ", ", kv, ", ", hd,
                  "] of the cache's dtype, each head's values adjacent; got ", t.sizes(), " ", t.scalar_type());
    write_new(keys, values, *new_keys, *new_values, lp);
  }
  at::Tensor out = at::empty_like(q);
  const float sc = static_cast<float>(scale);
  dispatch(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const RowMaps maps{cache_rows.has_value() ? rc.data_ptr<int64_t>() : nullptr,
                       pr.defined() ? pr.data_ptr<int64_t>() : nullptr, pl.defined() ? pl.data_ptr<int64_t>() : nullptr};
    attend<T>(q.data_ptr<T>(), keys.data_ptr<T>(), values.data_ptr<T>(), lp, maps, out.data_ptr<T>(), rows, kv, g, cap,
              hd, sc);
  });
  return out;
}

// 16 where the kernels were built with their AVX-512 paths, 1 for the plain C++ loops.
int64_t simd_lanes() {
#ifdef AREAL_FLOW_AVX512
  return 16;
#else
  return 1;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(areal_flow, m) {
  m.def("simd_lanes() -> int", TORCH_FN(simd_lanes));
  m.def("decode_attention(Tensor q, Tensor(a!) keys, Tensor(b!) values, Tensor lens, float scale, "
        "Tensor? cache_rows=None, Tensor? new_keys=None, Tensor? new_values=None, Tensor? prefix_rows=None, "
        "Tensor? prefix_lens=None) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
