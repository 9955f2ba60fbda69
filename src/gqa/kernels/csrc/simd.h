// The small SIMD vector layer the gqa CPU kernels are written against: a `vec` holds LANES floats (16 with
// AVX-512, 8 with AVX2 + FMA, 1 otherwise), with loads from float32 and bfloat16, FMA, reductions and exp.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#define GQA_SIMD 16
#elif defined(__AVX2__) && defined(__FMA__)
#define GQA_SIMD 8
#else
#define GQA_SIMD 1
#endif

#if GQA_SIMD > 1
#include <immintrin.h>
#endif

namespace gqa_simd {

using at::BFloat16;

inline float to_float(float x) { return x; }
inline float to_float(BFloat16 x) { return static_cast<float>(x); }

// The kernels below are written once against this small vector layer: a `vec` holds LANES floats.
#if GQA_SIMD == 16
using vec = __m512;
constexpr int LANES = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset(float x) { return _mm512_set1_ps(x); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const BFloat16* p) {  // bf16 -> f32 is a 16-bit left shift
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, vec x) { _mm512_storeu_ps(p, x); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec vblend_negative(vec x, vec a, vec b) {  // x < 0 ? b : a, lane by lane
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), a, b);
}
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }  // a > b ? a : b: NaN in either gives b
inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }  // a < b ? a : b: NaN in either gives b
inline vec vmax_nan(vec m, vec x) {  // max(m, x) that keeps a NaN of either (so NaN scores give NaN, as in torch)
  return _mm512_mask_mov_ps(_mm512_max_ps(x, m), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}
inline float vmaxof(vec x) { return _mm512_reduce_max_ps(x); }
inline bool vany_nan(vec x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) != 0; }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline vec vfnma(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline float vsum(vec x) { return _mm512_reduce_add_ps(x); }
inline vec vround(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vpow2(vec p, vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral

// Lane i of the result = the sum of the 16 lanes of a[i]: a transposing reduction, ~3 instructions per key instead
// of a full horizontal sum per (row, key).
inline vec reduce_lanes(vec* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));  // float adds: the pd ops only move pairs
  }
  // c[i], 128-bit lane j: partial sums of keys 4i..4i+3 over lane j. Sum the four 128-bit lanes.
  __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}
#elif GQA_SIMD == 8
using vec = __m256;
constexpr int LANES = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset(float x) { return _mm256_set1_ps(x); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, vec x) { _mm256_storeu_ps(p, x); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec vblend_negative(vec x, vec a, vec b) {  // x < 0 ? b : a, lane by lane
  return _mm256_blendv_ps(a, b, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }  // a > b ? a : b: NaN in either gives b
inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }  // a < b ? a : b: NaN in either gives b
inline vec vmax_nan(vec m, vec x) {  // max(m, x) that keeps a NaN of either (so NaN scores give NaN, as in torch)
  return _mm256_blendv_ps(_mm256_max_ps(x, m), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
inline float vmaxof(vec x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline bool vany_nan(vec x) { return _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0; }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vfnma(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline float vsum(vec x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline vec vround(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vpow2(vec p, vec n) {  // p * 2^n through the exponent bits; n in [-126, 127] (vexp's clamp keeps it so)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Lane i of the result = the sum of the 8 lanes of a[i] (two rounds of pairwise adds, then the 128-bit halves).
inline vec reduce_lanes(vec* a) {
  const __m256 c0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 c1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}
#endif

#if GQA_SIMD > 1
// exp(x) for x <= 0 (softmax arguments), relative error ~2e-7; x is clamped at -87 (exp = 1.6e-38). NaN stays NaN.
inline vec vexp(vec x) {
  x = vmax(vset(-87.0f), x);  // the operand order lets a NaN through
  const vec n = vround(vmul(x, vset(1.44269504088896341f)));
  vec r = vfnma(n, vset(0.693359375f), x);  // x - n ln 2 in two parts
  r = vfnma(n, vset(-2.12194440e-4f), r);
  vec p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset(1.0f)));
  return vpow2(p, n);
}
#endif

}  // namespace gqa_simd
