// A prompt's product with a K-format matrix (q4_k, q5_k, q6_k) as a tiled GEMM: 16 weight rows are unpacked once into
// SIMD lanes (KTile: each group of four values of a row in its lane, as vpdpbusd takes them), then multiplied against
// the input rows KTILE_X at a time, each input row's four int8 values broadcast to every lane by a load (vpbroadcastd
// from the row as quantize_rows stores it: no shuffle). Per four values: one 64-byte load for KTILE_X vpdpbusd.
// row_lanes.h's lanes_kdot (the input rows in lanes, a weight row's bytes spread to them) unpacks a weight row's
// super-blocks again for every group of 16 input rows and loads the group's inputs again for every weight row: on a 3B
// Q4_K_M prompt (Zen 4) it issued one vpdpbusd every ~5 cycles; this one reaches ~2/3 of the core's vpdpbusd rate
// (docs/bench/models-3b-8b.md). Tried and dropped: 8 input rows a pass (the float chains no longer fit in registers:
// half the speed), the broadcast folded into vpdpbusd's memory operand (the same speed).
//
// Each lane does what lanes_kdot's lane, and kdot1, do for its (input row, weight row): the same exact integer sums
// (q6_k: (q + 32) . x less 32 * (the half's sum of x), times the half's scale), the same float chains in the same
// order (acc[b % 4] per sub-block b, the minima's after as a pass of their own: what Chains::sum adds), so a row's
// result does not depend on its batch or on which kernel took it.
#pragma once

#include <algorithm>
#include <cstring>

#include "k_quants.h"
#include "row_lanes.h"

#if defined(GQA_ROW_LANES)

namespace gqa_blocks {

constexpr int KTILE_X = 4;  // input rows per pass over a tile

// 16 weight rows of nb sub-blocks unpacked: at w[(8b + j) * 64 + 4r] the four unsigned q (q6_k: q + 32) 4j .. 4j + 3
// of sub-block b of row r; per sub-block b, at [16b + r]: dw and mw (super_scales'), q6_k's two int8 scales at
// sc[32b + r] and sc[32b + 16 + r]. Rows past the matrix's last are zeros.
struct KTile {
  gqa::LineVector<int8_t> w;
  gqa::LineVector<float> dw, mw;
  gqa::LineVector<int32_t> sc;
  std::vector<uint8_t> rows;  // scratch: the rows' q in order, (16, 32 * nb)
};

// 8 rows of 8 int32 each -> r[j] = column j.
inline void transpose8_epi32(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3 (t0-t3), 4-7 (t4-t7)
    u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);      // columns 0, 4
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);  // 1, 5
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);  // 2, 6
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);  // 3, 7
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

// Unpacks `rows` (<= 16) weight rows at w (row_bytes apart, nb sub-blocks each) into t.
template <int F>
inline void unpack_ktile(const uint8_t* w, int64_t rows, int64_t row_bytes, int64_t nb, KTile& t) {
  const int64_t K = nb * QK;
  t.w.resize(16 * K), t.dw.resize(16 * nb), t.mw.resize(16 * nb), t.rows.resize(16 * K);
  if constexpr (F == Q6_K) t.sc.resize(32 * nb);
  if (rows < 16) {  // the lanes past the matrix multiply zeros
    std::fill(t.rows.begin() + rows * K, t.rows.end(), 0);
    std::fill(t.dw.begin(), t.dw.end(), 0.0f), std::fill(t.mw.begin(), t.mw.end(), 0.0f);
    std::fill(t.sc.begin(), t.sc.end(), 0);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t s = 0; s < nb / 8; ++s) {
      const uint8_t* sb = w + r * row_bytes + s * block_bytes_of(F);
      prefetch_ahead(sb, block_bytes_of(F));  // the rows come from DRAM once (see blocks.h)
      const SuperScales scales = super_scales<F>(sb);
      for (int j0 = 0; j0 < 8; j0 += 4) {
        __m256i wq[4], unused[4];
        k_quad<F>(sb, j0, wq, unused);
        for (int i = 0; i < 4; ++i) {
          const int64_t b = s * 8 + j0 + i;
          const __m256i q = F == Q6_K ? _mm256_add_epi8(wq[i], _mm256_set1_epi8(32)) : wq[i];
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.rows.data() + r * K + b * QK), q);
          t.dw[16 * b + r] = scales.dw[j0 + i], t.mw[16 * b + r] = scales.mw[j0 + i];
          if constexpr (F == Q6_K) {
            t.sc[32 * b + r] = static_cast<int8_t>(sb[192 + 2 * (j0 + i)]);
            t.sc[32 * b + 16 + r] = static_cast<int8_t>(sb[193 + 2 * (j0 + i)]);
          }
        }
      }
    }
  for (int64_t b = 0; b < nb; ++b)
    for (int h = 0; h < 2; ++h) {  // rows 0-7, 8-15 of sub-block b: their eight fours each, to lanes
      __m256i v[8];
      for (int r = 0; r < 8; ++r)
        v[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.rows.data() + (8 * h + r) * K + b * QK));
      transpose8_epi32(v);
      for (int j = 0; j < 8; ++j)
        _mm256_store_si256(reinterpret_cast<__m256i*>(t.w.data() + (8 * b + j) * 64 + 32 * h), v[j]);
    }
}

// q6_k's start of each sub-block's two integer sums: -32 * the sums of x over its halves, (N, nb, 2).
inline std::vector<int32_t> q6_offsets(const gqa::QuantizedRows& xr) {
  std::vector<int32_t> o(2 * xr.sum.size());
  for (size_t i = 0; i < xr.sum.size(); ++i)
    o[2 * i] = -32 * xr.sum_lo[i], o[2 * i + 1] = -32 * (xr.sum[i] - xr.sum_lo[i]);
  return o;
}

// out[(n - n0) * stride + r] (r < `lanes`) for input rows n0 .. n0 + X - 1 and the tile's rows (offsets: q6_offsets).
template <int F, int X>
inline void ktile_dot(const KTile& t, int64_t nb, const gqa::QuantizedRows& xr, const int32_t* offsets, int64_t n0,
                      int lanes, float* out, int64_t stride) {
  using S = Lanes<16>;
  const int64_t K = nb * QK;
  const int8_t* xq = xr.q.data() + n0 * K;
  const float* xd = xr.d.data() + n0 * nb;
  __m512 acc[X][4];
  for (int n = 0; n < X; ++n)
    for (int c = 0; c < 4; ++c) acc[n][c] = S::zero();
  for (int64_t b0 = 0; b0 < nb; b0 += 4)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // chain c takes sub-block b0 + c (nb is a multiple of 8)
      const int64_t b = b0 + c;
      __m512i p[X][2];
#pragma GCC unroll 4
      for (int n = 0; n < X; ++n) {
        if constexpr (F == Q6_K) {  // less 32 * the halves' sums of x
          p[n][0] = _mm512_set1_epi32(offsets[2 * ((n0 + n) * nb + b)]);
          p[n][1] = _mm512_set1_epi32(offsets[2 * ((n0 + n) * nb + b) + 1]);
        } else {
          p[n][0] = p[n][1] = S::izero();
        }
      }
      const int8_t* wb = t.w.data() + b * 8 * 64;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i w = _mm512_load_si512(wb + j * 64);
#pragma GCC unroll 4
        for (int n = 0; n < X; ++n) {
          int32_t four;
          std::memcpy(&four, xq + n * K + b * QK + 4 * j, 4);
          p[n][j / 4] = _mm512_dpbusd_epi32(p[n][j / 4], w, _mm512_set1_epi32(four));
        }
      }
      const __m512 dw = _mm512_load_ps(t.dw.data() + 16 * b);
#pragma GCC unroll 4
      for (int n = 0; n < X; ++n) {
        __m512i sum;
        if constexpr (F == Q6_K) {
          sum = S::iadd(_mm512_mullo_epi32(p[n][0], _mm512_load_si512(t.sc.data() + 32 * b)),
                        _mm512_mullo_epi32(p[n][1], _mm512_load_si512(t.sc.data() + 32 * b + 16)));
        } else {
          sum = S::iadd(p[n][0], p[n][1]);
        }
        acc[n][c] = S::fma(S::cvt(sum), S::mul(dw, S::set1(xd[n * nb + b])), acc[n][c]);
      }
    }
  const __mmask16 keep = static_cast<__mmask16>((1u << lanes) - 1);
  for (int n = 0; n < X; ++n) {
    __m512 mins[4] = {S::zero(), S::zero(), S::zero(), S::zero()};
    if constexpr (F != Q6_K)
      for (int64_t b0 = 0; b0 < nb; b0 += 4)
        for (int c = 0; c < 4; ++c)
          mins[c] = S::fma(_mm512_load_ps(t.mw.data() + 16 * (b0 + c)),
                           S::set1(xr.ds[(n0 + n) * nb + b0 + c]), mins[c]);
    const __m512 a = S::add(S::add(acc[n][0], acc[n][2]), S::add(acc[n][1], acc[n][3]));
    const __m512 m = S::add(S::add(mins[0], mins[2]), S::add(mins[1], mins[3]));
    _mm512_mask_storeu_ps(out + n * stride, keep, S::add(a, m));
  }
}

}  // namespace gqa_blocks

#endif
