// gqa CPU kernels for GGUF block-quantized weights (built with cpu_kernels.cpp; see gqa/kernels/__init__.py).
//
// A weight matrix (M, K) is kept as it is in the GGUF file: M rows of K / 32 blocks, each block 32 weights:
//   q8_0 (34 bytes): fp16 d, 32 int8 q            w = d * q
//   q4_0 (18 bytes): fp16 d, 16 bytes of nibbles  w = d * (q - 8)
//   q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes      w = d * q + m
//   q5_0 (22 bytes): fp16 d, 4 bytes qh, 16 bytes  w = d * (q - 16)
//   q5_1 (24 bytes): fp16 d, fp16 m, 4 bytes qh, 16 bytes      w = d * q + m
// (nibbles: byte j holds weight j in its low 4 bits and weight j + 16 in its high 4 bits; 5-bit q: bit i of the
// little-endian 32-bit qh is weight i's fifth bit, value 16). llama.cpp's K formats (q4_k, q5_k, q6_k: super-blocks
// of 256 values, eight 32-value sub-blocks with their own scales) are in k_quants.h; their rows are K / 256 blocks.
//
//   gqa::qlinear_rows_n(x (N, K), blocks [(M_i, K / 32 * bytes)], formats [int], biases [(M_i,)?]) -> [(N, M_i)]
//       y = x @ dequant(W)^T + bias for a few rows N (decode), as llama.cpp computes it: each 32-value block of x is
//       quantized to int8 with its own scale (d_x = max|x| / 127), and a weight block's dot product with it is one
//       integer dot product (AVX512-VNNI vpdpbusd / AVX2 vpmaddubsw, unsigned 4/8-bit weights x signed 8-bit
//       activations) times d_w * d_x. Every thread streams its share of the weight rows once for all N rows.
//       An input block holding a NaN, an infinity or a value beyond 2^64 in magnitude (whose scaled integer sums
//       could overflow float32 and add +inf to -inf) is left out of the integer products (q = 0, d = 0) and its dot
//       products with the weight blocks are taken in float, d * q (+ m) times x, and added to the row's sum, so such
//       inputs give what x @ dequant(W)^T gives in float (NaN, +-inf, or a huge finite sum) — the rows without one
//       take the integer path alone, unchanged. A weight block whose fp16 scale is inf or NaN (a damaged file) makes
//       its outputs non-finite on the integer path; those are taken again in float, as gguf's dequantized weights give
//       them in float math (redo_nonfinite_scales).
//       With AVX-512 VNNI and 4 or more rows, the rows go through row_lanes.h (rows in SIMD lanes: 2-4x the
//       products per second at 8-64 rows), with the same sums; the K formats from 9 rows (q6_k: 32) through
//       k_tiles.h (weight rows unpacked once into lanes, input rows broadcast: 1.5-1.7x lanes_kdot's rate at 64-512
//       rows), again with the same sums.
//   gqa::lane_rows() -> int: the fewest rows that take row_lanes.h's kernels; 0 where the build has none.
//   gqa::dequantize_rows(blocks (M, K / 32 * bytes), format, K, dtype) -> (M, K) of dtype
//       the float weights (prefill, embedding rows), exactly gguf's (d * (q - offset), d * q + m, ...) rounded to dtype.
//
// x and y are float32 or bfloat16; formats: 0 = q8_0, 1 = q4_0, 2 = q4_1, 3 = q5_0, 4 = q5_1, 5 = q4_k, 6 = q5_k,
// 7 = q6_k.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "blocks.h"
#include "k_quants.h"
#include "k_tiles.h"
#include "quantized.h"
#include "row_lanes.h"

namespace {

using namespace gqa_blocks;

// Bytes of a weight row of K values (K a multiple of the format's block).
int64_t row_bytes_of(int64_t format, int64_t K) { return K / block_values(format) * block_bytes(format); }

using gqa::QuantizedRows;

// The largest input magnitude the integer path takes. Per block, |s_b * d_w * d_x| <= 32 * 128 * 127 * 65504 *
// amax / 127 < 2^28 * amax (q6_k's int8 scales and q4_k's/q5_k's 6-bit ones make it < 2^34 * amax), and the min
// term is smaller: below 2^64 a row's float32 sums cannot overflow for any K < 2^30. Larger (finite) inputs are taken in float, with the non-finite ones.
constexpr float INTEGER_PATH_MAX = 18446744073709551616.0f;  // 2^64

// Inputs of at least this many rows go through row_lanes.h's kernels (AVX-512 VNNI builds).
constexpr int64_t LANE_ROWS = 4;

#if defined(GQA_ROW_LANES)
constexpr bool LANES_BUILT = true;
#else
constexpr bool LANES_BUILT = false;
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define GQA_VECTOR_QUANTIZE 1
// 16 values as float32 (bfloat16: its bits shifted up, exactly to_float's value).
inline __m512 floats16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 floats16(const BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

// x (N, K) quantized per block of 32 (d = amax / 127, q = round-to-nearest-even(x * (1 / d))); with AVX-512 a block
// at a time in two vectors (the same values: every step is exact or rounds once, as the scalar loop does).
template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t N, int64_t K) {
  const int64_t nb = K / QK;
  const bool lanes = LANES_BUILT && N >= LANE_ROWS;  // the rows go in lane groups, or dot4 reads them
  const int64_t n4 = lanes ? 0 : N / 4 * 4;          // the rows dot4 reads, in groups of four
  QuantizedRows r{std::vector<int8_t>(N * K), std::vector<float>(N * nb), std::vector<float>(N * nb), {},
                  std::vector<float>(nb * n4), std::vector<float>(nb * n4), n4};
#if !defined(GQA_VECTOR_QUANTIZE)
  std::vector<float> xf(QK);
#endif
  // the lanes' integer sums of each block's q, and of its first 16
  if (lanes) r.sum.assign(N * nb, 0), r.sum_lo.assign(N * nb, 0);
  int32_t* isum = r.sum.data();
  int32_t* isum_lo = r.sum_lo.data();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      const T* xb = x + n * K + b * QK;
#if defined(GQA_VECTOR_QUANTIZE)
      const __m512 lo = floats16(xb), hi = floats16(xb + 16), alo = _mm512_abs_ps(lo), ahi = _mm512_abs_ps(hi);
      const __m512 limit = _mm512_set1_ps(INTEGER_PATH_MAX);  // (NaN compares false)
      const bool finite =
          (_mm512_cmp_ps_mask(alo, limit, _CMP_LE_OQ) & _mm512_cmp_ps_mask(ahi, limit, _CMP_LE_OQ)) == 0xFFFF;
      const float amax = finite ? _mm512_reduce_max_ps(_mm512_max_ps(alo, ahi)) : 0.0f;
#else
      float amax = 0.0f;
      bool finite = true;
      for (int64_t i = 0; i < QK; ++i) {
        xf[i] = to_float(xb[i]);
        const float a = std::fabs(xf[i]);
        amax = std::max(amax, a);
        finite &= a <= INTEGER_PATH_MAX;  // false for +-inf and NaN (which std::max drops) too
      }
#endif
      int8_t* qb = r.q.data() + n * K + b * QK;
      if (!finite) {  // taken in float by add_float_blocks; q, d, ds stay 0
        r.nonfinite.push_back(n * nb + b);
        continue;
      }
      const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
      if (!(id <= std::numeric_limits<float>::max())) {  // amax < ~3.7e-37: 1 / d overflows to inf, and x * id
        r.d[n * nb + b] = d;                                // (inf or NaN) has no int8: the block's q stay 0
        continue;
      }
#if defined(GQA_VECTOR_QUANTIZE)
      // vcvtps2dq rounds in the current mode, as std::nearbyint does (to nearest, ties to even)
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + QK / 2), _mm512_cvtepi32_epi8(qhi));
      const int32_t sum_lo = _mm512_reduce_add_epi32(qlo), sum = sum_lo + _mm512_reduce_add_epi32(qhi);
      if (lanes) isum_lo[n * nb + b] = sum_lo;
#else
      int32_t sum = 0;
      for (int64_t i = 0; i < QK; ++i) {
        qb[i] = static_cast<int8_t>(std::nearbyint(xf[i] * id));
        sum += qb[i];
        if (lanes && i == QK / 2 - 1) isum_lo[n * nb + b] = sum;
      }
#endif
      r.d[n * nb + b] = d;
      r.ds[n * nb + b] = d * static_cast<float>(sum);
      if (lanes) isum[n * nb + b] = sum;
    }
  for (int64_t n = 0; n < n4; ++n)
    for (int64_t b = 0; b < nb; ++b) r.dt[b * n4 + n] = r.d[n * nb + b], r.dst[b * n4 + n] = r.ds[n * nb + b];
#if defined(GQA_ROW_LANES)
  if (lanes) pack_lanes(r, isum, isum_lo, N, K);
#endif
  return r;
}

// The unsigned q of weight i of a 4- or 5-bit block.
inline int32_t small_q(const uint8_t* blk, int64_t format, int64_t i) {
  const uint8_t byte = blk[nibbles_at(format) + (i % 16)];
  int32_t q = i < 16 ? (byte & 0x0F) : (byte >> 4);
  if (five_bit(format)) {
    uint32_t qh;
    std::memcpy(&qh, blk + high_bits_at(format), 4);
    q |= static_cast<int32_t>((qh >> i) & 1u) << 4;
  }
  return q;
}

// The 32 float weights of 32-value block b of a weight row, as llama.cpp dequantizes them (float32).
inline void block_weights(const uint8_t* row, int64_t format, int64_t b, float* out) {
  if (k_quant(format)) return k_weights(row + b / 8 * block_bytes_of(format), format, static_cast<int>(b % 8), out);
  const uint8_t* blk = row + b * block_bytes_of(format);
  const float d = half_at(blk);
  if (format == Q8_0) {
    for (int64_t i = 0; i < QK; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(blk[2 + i]));
    return;
  }
  if (has_min(format)) {
    const float m = half_at(blk + 2);
    for (int64_t i = 0; i < QK; ++i) out[i] = d * static_cast<float>(small_q(blk, format, i)) + m;
    return;
  }
  // d * (q - offset), as gguf has it: with an infinite d, d * q - offset * d would be inf - inf (NaN) for every q
  // (finite d: the same bits, both exact)
  for (int64_t i = 0; i < QK; ++i) out[i] = d * (static_cast<float>(small_q(blk, format, i)) - q_offset(format));
}

// buf (N, rows) += the float dot products of the input blocks the integer path leaves out (xr.nonfinite) with
// weight rows w (rows of row_bytes bytes): sums of inf * w and NaN give what the float product gives (+-inf, NaN where
// inf * 0 or inf - inf).
template <typename T>
void add_float_blocks(const T* x, const QuantizedRows& xr, int64_t K, const uint8_t* w, int64_t format,
                          int64_t rows, int64_t row_bytes, float* buf) {
  const int64_t nb = K / QK;
  float wb[QK];
  for (const int64_t nbi : xr.nonfinite) {
    const int64_t n = nbi / nb, b = nbi % nb;
    const T* xb = x + n * K + b * QK;
    for (int64_t i = 0; i < rows; ++i) {
      block_weights(w + i * row_bytes, format, b, wb);
      float s = 0.0f;
      for (int64_t j = 0; j < QK; ++j) s += to_float(xb[j]) * wb[j];
      buf[n * rows + i] += s;
    }
  }
}

// Whether a weight row of K values holds a block whose fp16 scale (d; m of q4_1 and q5_1; dmin of q4_k and q5_k) is
// an infinity or a NaN.
inline bool nonfinite_scales(const uint8_t* row, int64_t format, int64_t K) {
  const int64_t blocks = K / block_values(format), bytes = block_bytes_of(format);
  const int64_t d_at = format == Q6_K ? 208 : 0;
  const bool second = has_min(format) || format == Q4_K || format == Q5_K;
  const auto nonfinite = [](const uint8_t* p) {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return (bits & 0x7C00) == 0x7C00;  // the exponent all ones
  };
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * bytes;
    if (nonfinite(blk + d_at) || (second && nonfinite(blk + 2))) return true;
  }
  return false;
}

// Weight blocks with an infinite or NaN scale. The integer path takes a block's product as d_w * d_x * s_b plus the
// minimum's term, where float math has the sum of 32 products d_w * (q_j - offset) * x_j: with d_w = inf those differ
// (inf * 0 is NaN for a zero q_j - offset or x_j, signs that mix give NaN where s_b has one sign, and d * q - 8d is
// inf - inf). What such a product must be ("matching gguf"): float32 math on the numbers the integer path multiplies,
// each weight as gguf.quants.dequantize has it (d * (q - offset), d * q + m, d * sc * q - dmin * m, d * sc * (q - 32))
// times each input as quantized (q_x * d_x; an input block taken in float, add_float_blocks': its own value), summed:
// NaN where any product is NaN or +inf meets -inf, else +-inf. Such a block always makes the integer path's sum
// non-finite (inf or NaN times anything stays so) and finite ones never do (INTEGER_PATH_MAX), so the non-finite
// results of the weight rows that hold one are taken again, in float; every other output stays as it is (a non-finite
// one of a finite row: add_float_blocks' inputs), and the hot loops are unchanged: one pass over the results (1-16 rows
// of SmolLM2's and a 1B model's matrices, one thread: 0.95-1.04x the time without it, noise either way).
template <typename T>
void redo_nonfinite_scales(const T* x, const QuantizedRows& xr, int64_t K, const uint8_t* w, int64_t format,
                           int64_t rows, int64_t row_bytes, int64_t N, float* buf) {
  uint32_t top = 0;  // any exponent all ones (inf, NaN): integer operations the compiler vectorizes
  for (int64_t k = 0; k < N * rows; ++k) {
    uint32_t bits;
    std::memcpy(&bits, buf + k, 4);
    top |= ((bits & 0x7F800000u) == 0x7F800000u);
  }
  if (!top) return;
  const int64_t nb = K / QK;
  float wb[QK];
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* row = w + i * row_bytes;
    bool checked = false, redo = false;
    for (int64_t n = 0; n < N; ++n) {
      float& y = buf[n * rows + i];
      if (std::isfinite(y)) continue;
      if (!checked) redo = nonfinite_scales(row, format, K), checked = true;
      if (!redo) break;
      float sum = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        block_weights(row, format, b, wb);
        const T* xb = x + n * K + b * QK;
        const int8_t* qb = xr.q.data() + n * K + b * QK;
        const float d = xr.d[n * nb + b];
        const bool in_float = std::binary_search(xr.nonfinite.begin(), xr.nonfinite.end(), n * nb + b);
        for (int64_t j = 0; j < QK; ++j) sum += (in_float ? to_float(xb[j]) : static_cast<float>(qb[j]) * d) * wb[j];
      }
      y = sum;
    }
  }
}

// Every kernel below gives row n of x and weight row w the same float sum, whatever the other rows: per block b,
// the exact integer dot product s_b of the weights' q with x's q, then in four chains c = b % 4 (ascending b)
//   acc_c = fma(float(s_b), d_w,b * d_x,b, acc_c)      min_c = fma(min_w,b, ds_x,b, min_c)
// and out = ((acc_0 + acc_2) + (acc_1 + acc_3)) + ((min_0 + min_2) + (min_1 + min_3)). dot4 runs four rows of x
// (a row per lane), dot1 one row (four blocks per step, a block per lane; eight, two per 512-bit product, with
// AVX-512 VNNI, the same sums), dot_rows 2 or 3 rows as dot1 does each; the serving engine's batch invariance rests on
// all of them giving the same bits (tested through the op).
#if defined(__AVX2__)
// The 8 int32 lanes of a weight block's products with 32 int8 inputs (q8_0: |w| as unsigned times sign(w) * x).
template <int F>
inline __m256i block_dot(const uint8_t* blk, const int8_t* xq) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  if constexpr (F == Q8_0) {
    const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    return dot_u8s8(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(x, wq));
  } else if constexpr (five_bit(F)) {  // q <= 31: |u * s| <= 31 * 128, no saturation in maddubs
    return dot_u8s8(_mm256_or_si256(nibbles(blk + nibbles_at(F)), fifth_bits(blk + high_bits_at(F))), x);
  } else {
    return dot_u8s8(nibbles(blk + nibbles_at(F)), x);
  }
}

inline __m128 halves4(const uint8_t* p, int64_t stride) {  // four fp16 values `stride` bytes apart, as floats
  uint16_t h[4];
  for (int j = 0; j < 4; ++j) std::memcpy(&h[j], p + j * stride, 2);
  __m128i v;
  std::memcpy(&v, h, 8);
  return _mm_cvtph_ps(v);
}

// out[n * stride] for rows n0 .. n0 + 3 of x and one weight row w (xr.dt / xr.dst: the scales block-major).
template <int F>
inline void dot4(const uint8_t* w, int64_t nb, const QuantizedRows& xr, int64_t n0, int64_t K, float* out,
                 int64_t stride) {
  constexpr int64_t BYTES = block_bytes_of(F);
  __m128 acc[4], mins[4];
  for (int c = 0; c < 4; ++c) acc[c] = _mm_setzero_ps(), mins[c] = _mm_setzero_ps();
  const int8_t* x = xr.q.data() + n0 * K;
  const float *dt = xr.dt.data() + n0, *dst = xr.dst.data() + n0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BYTES;
    if ((b & 3) == 0) prefetch_ahead(blk, 4 * BYTES);
    const float dw = half_at(blk);
    const int8_t* xb = x + b * QK;
    const __m128i s = sum4(block_dot<F>(blk, xb), block_dot<F>(blk, xb + K), block_dot<F>(blk, xb + 2 * K),
                           block_dot<F>(blk, xb + 3 * K));
    const __m128 scale = _mm_mul_ps(_mm_set1_ps(dw), _mm_loadu_ps(dt + b * xr.n4));
    acc[b & 3] = _mm_fmadd_ps(_mm_cvtepi32_ps(s), scale, acc[b & 3]);
    if constexpr (F != Q8_0)
      mins[b & 3] = _mm_fmadd_ps(_mm_set1_ps(block_min<F>(blk, dw)), _mm_loadu_ps(dst + b * xr.n4), mins[b & 3]);
  }
  store_chains4(acc, mins, out, stride);
}

// Four blocks' float steps in dot1's chains: s their integer sums, blk the first block, d and ds x's scales there.
template <int F>
inline void blocks_step(__m128i s, const uint8_t* blk, const float* d, const float* ds, __m128& acc, __m128& mins) {
  constexpr int64_t BYTES = block_bytes_of(F);
  const __m128 dw = halves4(blk, BYTES);
  acc = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(dw, _mm_loadu_ps(d)), acc);
  if constexpr (has_min(F)) mins = _mm_fmadd_ps(halves4(blk + 2, BYTES), _mm_loadu_ps(ds), mins);
  if constexpr (F == Q4_0 || F == Q5_0)
    mins = _mm_fmadd_ps(_mm_mul_ps(_mm_set1_ps(-q_offset(F)), dw), _mm_loadu_ps(ds), mins);
}

#if defined(GQA_ZMM_DOTS)
// Two blocks' weights as pair_dot multiplies them: 64 unsigned bytes (block blk's 32 values in each 128-bit quarter's
// order below, then the next block's; q8_0: |q|), and q8_0's signs.
struct PairWeights {
  __m512i u;
  __mmask64 negative = 0;
};

template <int F>
inline PairWeights pair_weights(const uint8_t* blk) {
  constexpr int64_t BYTES = block_bytes_of(F);
  if constexpr (F == Q8_0) {
    const __m512i q = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + BYTES + 2)), 1);
    return {_mm512_abs_epi8(q), _mm512_movepi8_mask(q)};
  } else {
    // each block's 16 nibble bytes twice: the low nibbles (weights 0-15), then the high ones (16-31)
    const __m512i bytes = _mm512_mask_broadcast_i32x4(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + nibbles_at(F)))), 0xFF00,
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + BYTES + nibbles_at(F))));
    const int64_t four = 0x0004000400040004;
    __m512i q = _mm512_and_si512(_mm512_srlv_epi16(bytes, _mm512_setr_epi64(0, 0, four, four, 0, 0, four, four)),
                                 _mm512_set1_epi8(0x0F));
    if constexpr (five_bit(F))
      q = _mm512_or_si512(q, _mm512_inserti64x4(_mm512_castsi256_si512(fifth_bits(blk + high_bits_at(F))),
                                                fifth_bits(blk + BYTES + high_bits_at(F)), 1));
    return {q};
  }
}

// 16 int32 lanes, 8 summing to the first block's integer dot product with the 32 inputs at xq and 8 to the next
// block's with the next 32: block_dot's sums for two blocks in one 512-bit product (q8_0: |q| times x with q's sign).
template <int F>
inline __m512i pair_dot(const PairWeights& w, const int8_t* xq) {
  const __m512i x = _mm512_loadu_si512(xq), zero = _mm512_setzero_si512();
  if constexpr (F == Q8_0) return _mm512_dpbusd_epi32(zero, w.u, _mm512_mask_sub_epi8(x, w.negative, zero, x));
  return _mm512_dpbusd_epi32(zero, w.u, x);
}
#endif

// Rows n0 .. n0 + R - 1 (R = 2, 3) of x and one weight row w, into out[r * stride]: each row's dot1 (below), the same
// operations in the same order, the weights unpacked once for the R rows.
template <int F, int R>
inline void dot_rows(const uint8_t* w, int64_t nb, const QuantizedRows& xr, int64_t n0, int64_t K, float* out,
                     int64_t stride) {
  constexpr int64_t BYTES = block_bytes_of(F);
  RowChains<R> c(xr.q.data(), xr.d.data(), xr.ds.data(), n0, K, nb);
  const int8_t* x = c.x;
  const float *d = c.d, *ds = c.ds;
  int64_t b = 0;
#if defined(GQA_ZMM_DOTS)
  for (; b + 8 <= nb; b += 8) {  // eight blocks from four 512-bit products: the same sums, ~1.4x the speed
    const uint8_t* blk = w + b * BYTES;
    prefetch_ahead(blk, 8 * BYTES);
    const PairWeights q[4] = {pair_weights<F>(blk), pair_weights<F>(blk + 2 * BYTES), pair_weights<F>(blk + 4 * BYTES),
                              pair_weights<F>(blk + 6 * BYTES)};
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = x + r * K + b * QK;
      const __m256i s = sum8_pairs(pair_dot<F>(q[0], xb), pair_dot<F>(q[1], xb + 2 * QK),
                                   pair_dot<F>(q[2], xb + 4 * QK), pair_dot<F>(q[3], xb + 6 * QK));
      const int64_t at = r * nb + b;
      blocks_step<F>(_mm256_castsi256_si128(s), blk, d + at, ds + at, c.acc[r], c.mins[r]);
      blocks_step<F>(_mm256_extracti128_si256(s, 1), blk + 4 * BYTES, d + at + 4, ds + at + 4, c.acc[r], c.mins[r]);
    }
  }
#endif
  for (; b + 4 <= nb; b += 4) {
    const uint8_t* blk = w + b * BYTES;
    prefetch_ahead(blk, 4 * BYTES);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = x + r * K + b * QK;
      const __m128i s = sum4(block_dot<F>(blk, xb), block_dot<F>(blk + BYTES, xb + QK),
                             block_dot<F>(blk + 2 * BYTES, xb + 2 * QK), block_dot<F>(blk + 3 * BYTES, xb + 3 * QK));
      blocks_step<F>(s, blk, d + r * nb + b, ds + r * nb + b, c.acc[r], c.mins[r]);
    }
  }
  if (b < nb) {  // the last 1-3 blocks; the other lanes add 0 * 0
    alignas(16) float dw[4] = {}, mw[4] = {};
    for (int j = 0; j < 4 && b + j < nb; ++j) {
      const uint8_t* blk = w + (b + j) * BYTES;
      dw[j] = half_at(blk), mw[j] = block_min<F>(blk, dw[j]);
    }
    for (int r = 0; r < R; ++r) {
      __m256i dots[4];
      alignas(16) float xd[4] = {}, xs[4] = {};
      for (int j = 0; j < 4; ++j) {
        dots[j] = _mm256_setzero_si256();
        if (b + j >= nb) continue;
        xd[j] = d[r * nb + b + j], xs[j] = ds[r * nb + b + j];
        dots[j] = block_dot<F>(w + (b + j) * BYTES, x + r * K + (b + j) * QK);
      }
      const __m128i s = sum4(dots[0], dots[1], dots[2], dots[3]);
      c.acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(_mm_load_ps(dw), _mm_load_ps(xd)), c.acc[r]);
      if constexpr (F != Q8_0) c.mins[r] = _mm_fmadd_ps(_mm_load_ps(mw), _mm_load_ps(xs), c.mins[r]);
    }
  }
  c.store(out, stride);
}

// Row n of x and one weight row w, eight blocks per step (AVX-512 VNNI), then four, then the last 1-3. Its own loop,
// not dot_rows<F, 1>: every decode step's GEMV, which measured 0-10% slower that way (noisy alternations).
template <int F>
inline float dot1(const uint8_t* w, int64_t nb, const QuantizedRows& xr, int64_t n, int64_t K) {
  constexpr int64_t BYTES = block_bytes_of(F);
  const int8_t* x = xr.q.data() + n * K;
  const float *d = xr.d.data() + n * (K / QK), *ds = xr.ds.data() + n * (K / QK);
  __m128 acc = _mm_setzero_ps(), mins = _mm_setzero_ps();
  int64_t b = 0;
#if defined(GQA_ZMM_DOTS)
  for (; b + 8 <= nb; b += 8) {  // eight blocks from four 512-bit products: the same sums, ~1.4x the speed
    const uint8_t* blk = w + b * BYTES;
    prefetch_ahead(blk, 8 * BYTES);
    const int8_t* xb = x + b * QK;
    const __m256i s = sum8_pairs(pair_dot<F>(pair_weights<F>(blk), xb),
                                 pair_dot<F>(pair_weights<F>(blk + 2 * BYTES), xb + 2 * QK),
                                 pair_dot<F>(pair_weights<F>(blk + 4 * BYTES), xb + 4 * QK),
                                 pair_dot<F>(pair_weights<F>(blk + 6 * BYTES), xb + 6 * QK));
    blocks_step<F>(_mm256_castsi256_si128(s), blk, d + b, ds + b, acc, mins);
    blocks_step<F>(_mm256_extracti128_si256(s, 1), blk + 4 * BYTES, d + b + 4, ds + b + 4, acc, mins);
  }
#endif
  for (; b + 4 <= nb; b += 4) {
    const uint8_t* blk = w + b * BYTES;
    prefetch_ahead(blk, 4 * BYTES);
    const int8_t* xb = x + b * QK;
    const __m128i s = sum4(block_dot<F>(blk, xb), block_dot<F>(blk + BYTES, xb + QK),
                           block_dot<F>(blk + 2 * BYTES, xb + 2 * QK), block_dot<F>(blk + 3 * BYTES, xb + 3 * QK));
    blocks_step<F>(s, blk, d + b, ds + b, acc, mins);
  }
  if (b < nb) {  // the last 1-3 blocks; the other lanes add 0 * 0
    __m256i dots[4];
    alignas(16) float dw[4] = {}, mw[4] = {}, xd[4] = {}, xs[4] = {};
    for (int j = 0; j < 4; ++j) {
      dots[j] = _mm256_setzero_si256();
      if (b + j >= nb) continue;
      const uint8_t* blk = w + (b + j) * BYTES;
      dw[j] = half_at(blk), mw[j] = block_min<F>(blk, dw[j]), xd[j] = d[b + j], xs[j] = ds[b + j];
      dots[j] = block_dot<F>(blk, x + (b + j) * QK);
    }
    const __m128i s = sum4(dots[0], dots[1], dots[2], dots[3]);
    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(_mm_load_ps(dw), _mm_load_ps(xd)), acc);
    if constexpr (F != Q8_0) mins = _mm_fmadd_ps(_mm_load_ps(mw), _mm_load_ps(xs), mins);
  }
  return sum_chains(acc, mins);
}
#else
// The same sums in scalar code.
template <int F>
inline float dot1(const uint8_t* w, int64_t nb, const QuantizedRows& xr, int64_t n, int64_t K) {
  constexpr int64_t BYTES = block_bytes_of(F);
  const int8_t* x = xr.q.data() + n * K;
  const float *d = xr.d.data() + n * (K / QK), *ds = xr.ds.data() + n * (K / QK);
  float acc[4] = {}, mins[4] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BYTES;
    const float dw = half_at(blk);
    int32_t dot = 0;
    for (int64_t i = 0; i < QK; ++i) {
      int32_t q;
      if constexpr (F == Q8_0) {
        q = static_cast<int8_t>(blk[2 + i]);
      } else {
        q = small_q(blk, F, i);
      }
      dot += q * x[b * QK + i];
    }
    acc[b & 3] = std::fma(static_cast<float>(dot), dw * d[b], acc[b & 3]);
    if constexpr (F != Q8_0) mins[b & 3] = std::fma(block_min<F>(blk, dw), ds[b], mins[b & 3]);
  }
  return ((acc[0] + acc[2]) + (acc[1] + acc[3])) + ((mins[0] + mins[2]) + (mins[1] + mins[3]));
}
#endif

#if defined(__AVX2__)
// Rows n0 .. n0 + count - 1 (count = 2, 3) of x and one weight row w, into out[r * stride]: dot1 (kdot1) for each,
// the weights unpacked once for them (SmolLM2 Q4_1, 2 threads: a 2-row pass of the whole model 1.2-1.3x the speed of a
// dot1 call per row, 3 rows 1.2-1.5x). Not inlined: qdot_rows' one-row loop then compiles as it did without it
// (inlined, one-thread 1-row products of K = 576 in L2 ran 3-6% slower).
template <int F>
__attribute__((noinline)) void few_rows(const uint8_t* w, int64_t nb, const QuantizedRows& xr, int64_t n0,
                                        int64_t count, int64_t K, float* out, int64_t stride) {
  if constexpr (k_quant(F)) {
    if (count == 3) return kdot_rows<F, 3>(w, nb, xr, n0, K, out, stride);
    return kdot_rows<F, 2>(w, nb, xr, n0, K, out, stride);
  } else {
    if (count == 3) return dot_rows<F, 3>(w, nb, xr, n0, K, out, stride);
    return dot_rows<F, 2>(w, nb, xr, n0, K, out, stride);
  }
}
#endif

constexpr int64_t ROW_BLOCK = 16;  // weight rows run against every group of x rows while they are in L1

#if defined(GQA_ROW_LANES)
// The K formats' product in tiles (k_tiles.h): 16 weight rows unpacked once, then every input row against them,
// KTILE_X at a time; from 9 input rows (more than one 8-lane group; q6_k from 32: its unpacking costs more), where it
// is faster than lanes_kdot (3B shapes, 2 threads: q4_k 8192 x 3072 at 9-10 rows 1.9-2.3 ms vs 2.9-3.3, at 16 rows
// 2.3 vs 2.6, at 8 the same; q6_k 3072 x 8192 at 32 rows 5.3 vs 5.8, at 16 rows 3.9 vs 3.0).
template <int F>
constexpr int64_t ktile_min_rows = F == Q6_K ? 32 : 9;

template <int F>
void lanes_krows(const uint8_t* w, int64_t rows, int64_t row_bytes, const QuantizedRows& xr, int64_t N, int64_t nb,
                 float* buf) {
  KTile t;
  const std::vector<int32_t> offsets = F == Q6_K ? q6_offsets(xr) : std::vector<int32_t>();
  for (int64_t i0 = 0; i0 < rows; i0 += 16) {
    const int lanes = static_cast<int>(std::min<int64_t>(16, rows - i0));
    unpack_ktile<F>(w + i0 * row_bytes, lanes, row_bytes, nb, t);
    int64_t n = 0;
    for (; n + KTILE_X <= N; n += KTILE_X)
      ktile_dot<F, KTILE_X>(t, nb, xr, offsets.data(), n, lanes, buf + n * rows + i0, rows);
    float* o = buf + n * rows + i0;
    if (N - n == 3) ktile_dot<F, 3>(t, nb, xr, offsets.data(), n, lanes, o, rows);
    if (N - n == 2) ktile_dot<F, 2>(t, nb, xr, offsets.data(), n, lanes, o, rows);
    if (N - n == 1) ktile_dot<F, 1>(t, nb, xr, offsets.data(), n, lanes, o, rows);
  }
}

// qdot_rows for x in lane groups (row_lanes.h), 16 groups (256 rows) at a time: those rows stay in L2 while a thread's
// weight rows stream past them.
template <int F>
void lanes_rows(const uint8_t* w, int64_t rows, int64_t row_bytes, const QuantizedRows& xr, int64_t nb, float* buf) {
  if constexpr (k_quant(F)) {
    const int64_t N = static_cast<int64_t>(xr.d.size()) / nb;
    if (N >= ktile_min_rows<F>) return lanes_krows<F>(w, rows, row_bytes, xr, N, nb, buf);
  }
  constexpr size_t GROUPS = 16;
  for (size_t g0 = 0; g0 < xr.groups.size(); g0 += GROUPS)
    for (int64_t i0 = 0; i0 < rows; i0 += ROW_BLOCK)
      for (size_t gi = g0; gi < std::min(xr.groups.size(), g0 + GROUPS); ++gi) {
        const QuantizedRows::LaneGroup& g = xr.groups[gi];
        for (int64_t i = i0; i < std::min(rows, i0 + ROW_BLOCK); ++i) {
          float* o = buf + g.n0 * rows + i;
          if constexpr (k_quant(F)) {
            if (g.lanes == 16) {
              lanes_kdot<F, 16>(w + i * row_bytes, nb, xr, g, o, rows);
            } else {
              lanes_kdot<F, 8>(w + i * row_bytes, nb, xr, g, o, rows);
            }
          } else if (g.lanes == 16) {
            lanes_dot<F, 16>(w + i * row_bytes, nb, xr, g, o, rows);
          } else {
            if constexpr (pair_lanes<F>) {
              if (g.twice >= 0 && i + 1 < std::min(rows, i0 + ROW_BLOCK)) {
                // two weight rows at once (the last of an odd count alone, below)
                lanes_pair_dot<F>(w + i * row_bytes, row_bytes, nb, xr, xr.twice[g.twice], o, rows), ++i;
                continue;
              }
            }
            lanes_dot<F, 8>(w + i * row_bytes, nb, xr, g, o, rows);
          }
        }
      }
}
#endif

template <int F>
void qdot_rows(const uint8_t* w, int64_t rows, int64_t row_bytes, const QuantizedRows& xr, int64_t N, int64_t K,
               float* buf) {  // buf (N, rows)
  const int64_t nb = K / QK;
#if defined(GQA_ROW_LANES)
  if (!xr.groups.empty()) return lanes_rows<F>(w, rows, row_bytes, xr, nb, buf);
#endif
  for (int64_t i0 = 0; i0 < rows; i0 += ROW_BLOCK) {
    const int64_t i1 = std::min(rows, i0 + ROW_BLOCK);
    int64_t n0 = 0;
#if defined(__AVX2__)
    for (; n0 + 4 <= N; n0 += 4)
      for (int64_t i = i0; i < i1; ++i) {
        if constexpr (k_quant(F)) {
          kdot4<F>(w + i * row_bytes, nb, xr, n0, K, buf + n0 * rows + i, rows);
        } else {
          dot4<F>(w + i * row_bytes, nb, xr, n0, K, buf + n0 * rows + i, rows);
        }
      }
#endif
#if defined(__AVX2__)
    if (N - n0 >= 2) {  // the last 2-3 rows
      for (int64_t i = i0; i < i1; ++i)
        few_rows<F>(w + i * row_bytes, nb, xr, n0, N - n0, K, buf + n0 * rows + i, rows);
      continue;
    }
#endif
    for (; n0 < N; ++n0)
      for (int64_t i = i0; i < i1; ++i)
        buf[n0 * rows + i] = k_quant(F) ? kdot1<F>(w + i * row_bytes, nb, xr, n0, K)
                                        : dot1<F>(w + i * row_bytes, nb, xr, n0, K);
  }
}

// buf (N, rows) = x @ dequant(w)^T for `rows` weight rows of `format` at w; xr is x quantized by quantize_rows.
template <typename T>
void rows_dot(const uint8_t* w, int64_t format, int64_t rows, int64_t K, const QuantizedRows& xr, const T* x,
              int64_t N, float* buf) {
  const int64_t row_bytes = row_bytes_of(format, K);
  switch (format) {
    case Q8_0: qdot_rows<Q8_0>(w, rows, row_bytes, xr, N, K, buf); break;
    case Q4_0: qdot_rows<Q4_0>(w, rows, row_bytes, xr, N, K, buf); break;
    case Q4_1: qdot_rows<Q4_1>(w, rows, row_bytes, xr, N, K, buf); break;
    case Q5_0: qdot_rows<Q5_0>(w, rows, row_bytes, xr, N, K, buf); break;
    case Q5_1: qdot_rows<Q5_1>(w, rows, row_bytes, xr, N, K, buf); break;
    case Q4_K: qdot_rows<Q4_K>(w, rows, row_bytes, xr, N, K, buf); break;
    case Q5_K: qdot_rows<Q5_K>(w, rows, row_bytes, xr, N, K, buf); break;
    default: qdot_rows<Q6_K>(w, rows, row_bytes, xr, N, K, buf); break;
  }
  if (!xr.nonfinite.empty()) add_float_blocks(x, xr, K, w, format, rows, row_bytes, buf);
  redo_nonfinite_scales(x, xr, K, w, format, rows, row_bytes, N, buf);
}

struct QPart {
  const uint8_t* w;
  int64_t format;
  const void* bias;
  void* y;
  int64_t M;
  int64_t first_tile;
};

constexpr int64_t TILE = 8;  // weight rows per scheduling unit

template <typename T>
void qlinear_rows_impl(const at::Tensor& x, const std::vector<QPart>& parts) {
  const int64_t N = x.size(0), K = x.size(1);
  const QuantizedRows xr = quantize_rows(x.const_data_ptr<T>(), N, K);
  const int64_t tiles = parts.back().first_tile + (parts.back().M + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf;
    for (const QPart& part : parts) {
      const int64_t p0 = std::max(t0, part.first_tile), p1 = std::min(t1, part.first_tile + (part.M + TILE - 1) / TILE);
      if (p0 >= p1) continue;
      const int64_t M = part.M, m0 = (p0 - part.first_tile) * TILE, m1 = std::min(M, (p1 - part.first_tile) * TILE);
      const int64_t rows = m1 - m0, row_bytes = row_bytes_of(part.format, K);
      const uint8_t* wp = part.w + m0 * row_bytes;
      buf.resize(N * rows);
      rows_dot(wp, part.format, rows, K, xr, x.const_data_ptr<T>(), N, buf.data());
      const T* bp = static_cast<const T*>(part.bias);
      T* yp = static_cast<T*>(part.y);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < rows; ++i) {
          float v = buf[n * rows + i];
          if (bp) v += to_float(bp[m0 + i]);
          yp[n * M + m0 + i] = static_cast<T>(v);
        }
    }
  });
}

std::vector<at::Tensor> qlinear_rows_n(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef formats,
                                       const c10::List<c10::optional<at::Tensor>>& biases) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "gqa::qlinear_rows: x must be a contiguous (N, K) matrix, got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "gqa::qlinear_rows: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(!blocks.empty() && formats.size() == blocks.size() && biases.size() == blocks.size(),
              "gqa::qlinear_rows: one format and one bias (or None) per weight, and at least one weight");
  const int64_t K = x.size(1);
  std::vector<at::Tensor> outs;
  std::vector<QPart> parts;
  int64_t first_tile = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const at::Tensor& w = blocks[i];
    const int64_t values = block_values(formats[i]);  // (checks the format code)
    TORCH_CHECK(K % values == 0, "gqa::qlinear_rows: K = ", K, " is not a multiple of the format's block size ",
                values);
    const int64_t row_bytes = row_bytes_of(formats[i], K);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == row_bytes,
                "gqa::qlinear_rows: blocks must be contiguous uint8 (M, ", row_bytes, ") for K = ", K, ", got ",
                w.sizes());
    const c10::optional<at::Tensor> b = biases.get(i);
    if (b.has_value()) {
      TORCH_CHECK(b->dim() == 1 && b->size(0) == w.size(0) && b->is_contiguous() && b->scalar_type() == x.scalar_type(),
                  "gqa::qlinear_rows: bias must be contiguous (M,) of x's dtype, got ", b->sizes());
    }
    outs.push_back(at::empty({x.size(0), w.size(0)}, x.options()));
    if (w.size(0) == 0) continue;
    parts.push_back({w.const_data_ptr<uint8_t>(), formats[i], b.has_value() ? b->const_data_ptr() : nullptr,
                     outs.back().mutable_data_ptr(), w.size(0), first_tile});
    first_tile += (w.size(0) + TILE - 1) / TILE;
  }
  if (parts.empty() || x.size(0) == 0) return outs;
  if (x.scalar_type() == at::kFloat) {
    qlinear_rows_impl<float>(x, parts);
  } else {
    qlinear_rows_impl<BFloat16>(x, parts);
  }
  return outs;
}

template <typename T>
void dequantize_impl(const uint8_t* w, int64_t format, int64_t M, int64_t K, T* out) {
  const int64_t nb = K / QK, row_bytes = row_bytes_of(format, K);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    float wb[QK_K];
#if defined(__AVX2__)
    if (k_quant(format)) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t s = 0; s < K / QK_K; ++s) {
          const uint8_t* sb = w + r * row_bytes + s * block_bytes(format);
          if (format == Q4_K) k_super_weights<Q4_K>(sb, wb);
          if (format == Q5_K) k_super_weights<Q5_K>(sb, wb);
          if (format == Q6_K) k_super_weights<Q6_K>(sb, wb);
          T* o = out + r * K + s * QK_K;
          for (int64_t i = 0; i < QK_K; ++i) o[i] = static_cast<T>(wb[i]);
        }
      return;
    }
#endif
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        block_weights(w + r * row_bytes, format, b, wb);
        T* o = out + r * K + b * QK;
        for (int64_t i = 0; i < QK; ++i) o[i] = static_cast<T>(wb[i]);
      }
  });
}

at::Tensor dequantize_rows(const at::Tensor& blocks, int64_t format, int64_t K, at::ScalarType dtype) {
  const int64_t values = block_values(format);
  TORCH_CHECK(K > 0 && K % values == 0, "gqa::dequantize_rows: K = ", K, " is not a positive multiple of ", values);
  const int64_t row_bytes = row_bytes_of(format, K);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == row_bytes,
              "gqa::dequantize_rows: blocks must be contiguous uint8 (M, ", row_bytes, ") for K = ", K, ", got ",
              blocks.sizes());
  at::Tensor out = at::empty({blocks.size(0), K}, blocks.options().dtype(dtype));
  const uint8_t* w = blocks.const_data_ptr<uint8_t>();
  if (dtype == at::kFloat) {
    dequantize_impl<float>(w, format, blocks.size(0), K, out.mutable_data_ptr<float>());
  } else if (dtype == at::kBFloat16) {
    dequantize_impl<BFloat16>(w, format, blocks.size(0), K, out.mutable_data_ptr<BFloat16>());
  } else if (dtype == at::kHalf) {
    dequantize_impl<c10::Half>(w, format, blocks.size(0), K, out.mutable_data_ptr<c10::Half>());
  } else {
    TORCH_CHECK(false, "gqa::dequantize_rows: dtype must be float32, bfloat16 or float16, got ", dtype);
  }
  return out;
}

}  // namespace

std::vector<at::Tensor> gqa::quantized_linear_rows(const at::Tensor& x, at::TensorList blocks,
                                                   at::IntArrayRef formats,
                                                   const c10::List<c10::optional<at::Tensor>>& biases) {
  return qlinear_rows_n(x, blocks, formats, biases);
}

int64_t gqa::quantized_row_bytes(int64_t format, int64_t K) {
  TORCH_CHECK(K % block_values(format) == 0, "gqa: K = ", K, " is not a multiple of the block size ",
              block_values(format), " of quantization format ", format);
  return row_bytes_of(format, K);
}

QuantizedRows gqa::quantize_input(const float* x, int64_t N, int64_t K) { return quantize_rows(x, N, K); }
QuantizedRows gqa::quantize_input(const at::BFloat16* x, int64_t N, int64_t K) { return quantize_rows(x, N, K); }

void gqa::quantized_rows_dot(const uint8_t* w, int64_t format, int64_t rows, int64_t K, const QuantizedRows& xr,
                             const float* x, int64_t N, float* buf) {
  rows_dot(w, format, rows, K, xr, x, N, buf);
}
void gqa::quantized_rows_dot(const uint8_t* w, int64_t format, int64_t rows, int64_t K, const QuantizedRows& xr,
                             const at::BFloat16* x, int64_t N, float* buf) {
  rows_dot(w, format, rows, K, xr, x, N, buf);
}

namespace {

// The fewest input rows qlinear_rows_n runs through row_lanes.h's kernels, 0 in a build without them.
int64_t lane_rows() {
#if defined(GQA_ROW_LANES)
  return LANE_ROWS;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gqa, m) {
  m.def("lane_rows() -> int", &lane_rows);  // no tensor arguments: one kernel for every backend
  m.def("qlinear_rows_n(Tensor x, Tensor[] blocks, int[] formats, Tensor?[] biases) -> Tensor[]");
  m.def("dequantize_rows(Tensor blocks, int format, int K, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(gqa, CPU, m) {
  m.impl("qlinear_rows_n", &qlinear_rows_n);
  m.impl("dequantize_rows", &dequantize_rows);
}
