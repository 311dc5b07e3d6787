// Shared helpers of the engine's CPU kernels: fp32 / bf16 element access, and on CPUs with
// AVX-512 (F, BW, VL) 16-lane loads and stores of either dtype and a 16-lane exp.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace areal_flow {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }  // exact: the bits shifted up
template <typename T>
inline T narrow(float x) { return static_cast<T>(x); }  // bf16: round to nearest even (c10)

// fn(float{}) for fp32, else fn(c10::BFloat16{}) (callers check the dtype first): the element type
// as a generic lambda's argument type.
template <typename Fn>
void dispatch(c10::ScalarType dtype, Fn&& fn) {
  if (dtype == c10::ScalarType::Float)
    fn(float{});
  else
    fn(c10::BFloat16{});
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define AREAL_FLOW_AVX512 1

// exp of 16 floats: exp(x) = 2^n exp(r) with n = round(x / ln 2) and r = x - n ln 2 in
// [-ln2 / 2, ln2 / 2], ln 2 split in two parts so r is exact to ~1e-10 (Cody & Waite 1980), exp(r)
// by its Taylor polynomial to r^6 (truncation < r^7 / 7! = 6e-8 relative, so ~1-2 ulp in all), 2^n
// applied by scalef. Inputs are clamped to [-127, 88.7]: below, the result is exactly 0 (as
// exp(-inf)); above, +inf. NaN stays NaN (max/min return their second operand on NaN).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-127.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The lanes 0 .. len - 16 c - 1 of chunk c of a len-long vector (all 16 but in the last chunk).
inline __mmask16 chunk_mask(int64_t c, int64_t len) {
  const int64_t left = len - c * 16;
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }
inline void store16(c10::BFloat16* p, __m512 x, __mmask16 m) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));  // round to nearest even
#else
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, x);
  for (int e = 0; e < 16; ++e)
    if (m >> e & 1) p[e] = static_cast<c10::BFloat16>(tmp[e]);
#endif
}
#endif

}  // namespace areal_flow
