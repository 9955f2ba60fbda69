// Float GEMV for decode: a few input rows against a slice of weight rows, each weight row streamed once for all of
// them (used by gqa::linear_rows and the one-call decode step).
#pragma once
#include "simd.h"

namespace gqa_cpu {

using namespace gqa_simd;

// out[n * ldo + i] = sum_k W[i, k] x[n, k] for MR weight rows and NR input rows. The weights `pf` elements ahead are
// prefetched as we go (8 rows, at most 32 KB): the hardware prefetcher alone does not ramp up on short row streams
// (one core of the Zen 4 development machine: 20 -> 30 GB/s, a plain sum 34-38 GB/s).
template <typename T, int MR, int NR>
inline void gemv_tile(const T* W, int64_t K, const T* x, float* out, int64_t ldo) {
  int64_t k = 0;
  const int64_t pf = std::min<int64_t>(8 * K, 32768 / sizeof(T));
  float sums[MR][NR];
#if GQA_SIMD > 1
  vec acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int n = 0; n < NR; ++n) acc[i][n] = vzero();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, BFloat16>) {
    for (; k + 32 <= K; k += 32) {
      __m512bh xv[NR];
      for (int n = 0; n < NR; ++n) xv[n] = (__m512bh)_mm512_loadu_si512(x + n * K + k);
      for (int i = 0; i < MR; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(W + i * K + k + pf), _MM_HINT_T0);
        __m512bh w = (__m512bh)_mm512_loadu_si512(W + i * K + k);
        for (int n = 0; n < NR; ++n) acc[i][n] = _mm512_dpbf16_ps(acc[i][n], w, xv[n]);
      }
    }
  }
#endif
  for (; k + LANES <= K; k += LANES) {
    vec xv[NR];
    for (int n = 0; n < NR; ++n) xv[n] = vload(x + n * K + k);
    for (int i = 0; i < MR; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(W + i * K + k + pf), _MM_HINT_T0);
      const vec w = vload(W + i * K + k);
      for (int n = 0; n < NR; ++n) acc[i][n] = vfma(w, xv[n], acc[i][n]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int n = 0; n < NR; ++n) sums[i][n] = vsum(acc[i][n]);
#else
  for (int i = 0; i < MR; ++i)
    for (int n = 0; n < NR; ++n) sums[i][n] = 0.0f;
#endif
  for (; k < K; ++k)
    for (int i = 0; i < MR; ++i)
      for (int n = 0; n < NR; ++n) sums[i][n] += to_float(W[i * K + k]) * to_float(x[n * K + k]);
  for (int i = 0; i < MR; ++i)
    for (int n = 0; n < NR; ++n) out[n * ldo + i] = sums[i][n];
}

template <typename T, int NR>
void gemv_rows_nr(const T* W, int64_t K, const T* x, float* out, int64_t ldo, int64_t rows) {
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) gemv_tile<T, 4, NR>(W + i * K, K, x, out + i, ldo);
  for (; i < rows; ++i) gemv_tile<T, 1, NR>(W + i * K, K, x, out + i, ldo);
}

// out (N, rows) = x (N, K) @ W[0:rows]^T for N input rows, 4 at a time (each weight row is read once per 4 inputs).
// A row's sum does not depend on which tile or chunk computes it.
template <typename T>
void gemv_rows(const T* W, int64_t K, const T* x, int64_t N, int64_t rows, float* out) {
  for (int64_t n0 = 0; n0 < N; n0 += 4) {
    const int64_t nr = std::min<int64_t>(4, N - n0);
    const T* xn = x + n0 * K;
    float* on = out + n0 * rows;
    switch (nr) {
      case 1: gemv_rows_nr<T, 1>(W, K, xn, on, rows, rows); break;
      case 2: gemv_rows_nr<T, 2>(W, K, xn, on, rows, rows); break;
      case 3: gemv_rows_nr<T, 3>(W, K, xn, on, rows, rows); break;
      default: gemv_rows_nr<T, 4>(W, K, xn, on, rows, rows); break;
    }
  }
}

}  // namespace gqa_cpu
