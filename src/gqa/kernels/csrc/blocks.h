// What quantized.cpp, row_lanes.h and k_quants.h share: the block formats' codes, sizes and layouts, fp16 scales, the
// unpacking of 4- and 5-bit blocks, and the integer dot products of unsigned weight bytes with signed int8 inputs.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace gqa_blocks {

using at::BFloat16;

constexpr int64_t QK = 32;     // values per block of the input (and of the 32-value formats)
constexpr int64_t QK_K = 256;  // values per super-block of the K formats: eight 32-value sub-blocks
enum Format : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q5_0 = 3, Q5_1 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7 };

constexpr bool k_quant(int64_t f) { return f == Q4_K || f == Q5_K || f == Q6_K; }

// Bytes of one block (of 32 values, or a super-block of 256 for the K formats); 0 for an unknown code.
constexpr int64_t block_bytes_of(int64_t f) {
  constexpr int64_t bytes[] = {34, 18, 20, 22, 24, 144, 176, 210};
  return f >= 0 && f <= Q6_K ? bytes[f] : 0;
}

inline int64_t block_bytes(int64_t format) {
  TORCH_CHECK(block_bytes_of(format) > 0, "gqa: unknown quantization format code ", format,
              " (0 q8_0, 1 q4_0, 2 q4_1, 3 q5_0, 4 q5_1, 5 q4_k, 6 q5_k, 7 q6_k)");
  return block_bytes_of(format);
}

inline int64_t block_values(int64_t format) { return k_quant(format) ? QK_K : QK; }

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline float to_float(float x) { return x; }
inline float to_float(BFloat16 x) { return static_cast<float>(x); }

// Where a 32-value block's parts are: the minimum m (q4_1, q5_1) follows d; the fifth bits (q5_*) come before the
// nibbles.
constexpr bool has_min(int64_t f) { return f == Q4_1 || f == Q5_1; }
constexpr bool five_bit(int64_t f) { return f == Q5_0 || f == Q5_1; }
constexpr int64_t high_bits_at(int64_t f) { return has_min(f) ? 4 : 2; }
constexpr int64_t nibbles_at(int64_t f) { return high_bits_at(f) + (five_bit(f) ? 4 : 0); }
// The offset of q in w = d * (q - offset) (formats without m): 8 (q4_0), 16 (q5_0).
constexpr float q_offset(int64_t f) { return f == Q5_0 ? 16.0f : 8.0f; }


#if defined(__AVX2__)
// Weight rows come from the file's pages in DRAM, once per token: the hardware's stream prefetchers stop at each 4 KiB
// page, so the kernels ask for the bytes ~1.5 KiB ahead of those they read (Q4_K GEMV streamed from DRAM, 2 threads:
// 6.0 -> 11.6 GB/s; Q6_K 9.5 -> 15.6).
constexpr int64_t PREFETCH_DISTANCE = 1536;

// Prefetch the cache lines of [p + PREFETCH_DISTANCE, p + PREFETCH_DISTANCE + bytes) (past the end of a matrix: no
// fault, a wasted request).
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_DISTANCE + line, _MM_HINT_T0);
}

// Lane sums of u (unsigned bytes) * s (signed bytes), 8 int32 lanes: 4 products each.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));  // |u * s| <= 63 * 128: no saturation
#endif
}

// The full sums of four vectors of 8 int32 lanes (exact: every caller's |sum| < 2^24).
inline __m128i sum4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define GQA_ZMM_DOTS 1  // the AVX-512 VNNI kernels: these one-row products and row_lanes.h
// The full sums of eight blocks' dot products held two to a vector (z_k: 8 int32 lanes of block 2k, then 8 of block
// 2k + 1), in block order. Integer sums: exact in any order, so the same as sum4's of the blocks one by one.
inline __m256i sum8_pairs(__m512i z0, __m512i z1, __m512i z2, __m512i z3) {
  // 128-bit quarter i of u0: four lanes summing to block i (of u1: block 4 + i)
  const __m512i u0 = _mm512_add_epi32(_mm512_shuffle_i64x2(z0, z1, 0x88), _mm512_shuffle_i64x2(z0, z1, 0xDD));
  const __m512i u1 = _mm512_add_epi32(_mm512_shuffle_i64x2(z2, z3, 0x88), _mm512_shuffle_i64x2(z2, z3, 0xDD));
  // quarter i: block i's two partial sums in lanes 0, 2 and block 4 + i's in lanes 1, 3; then their totals
  const __m512i r = _mm512_add_epi32(_mm512_unpacklo_epi32(u0, u1), _mm512_unpackhi_epi32(u0, u1));
  const __m512i t = _mm512_add_epi32(r, _mm512_shuffle_epi32(r, _MM_PERM_BADC));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, t));
}
#endif

// ((a_0 + a_2) + (a_1 + a_3)) + ((m_0 + m_2) + (m_1 + m_3)) of four chains held as the lanes of acc and mins.
inline float sum_chains(__m128 acc, __m128 mins) {
  const __m128 a = _mm_add_ps(acc, _mm_movehl_ps(acc, acc)), m = _mm_add_ps(mins, _mm_movehl_ps(mins, mins));
  return (_mm_cvtss_f32(a) + _mm_cvtss_f32(_mm_movehdup_ps(a))) +
         (_mm_cvtss_f32(m) + _mm_cvtss_f32(_mm_movehdup_ps(m)));
}

// The same sums for four rows at once (a row per lane of acc[c] and mins[c]), stored at out[n * stride].
inline void store_chains4(const __m128* acc, const __m128* mins, float* out, int64_t stride) {
  const __m128 a = _mm_add_ps(_mm_add_ps(acc[0], acc[2]), _mm_add_ps(acc[1], acc[3]));
  const __m128 m = _mm_add_ps(_mm_add_ps(mins[0], mins[2]), _mm_add_ps(mins[1], mins[3]));
  float o[4];
  _mm_storeu_ps(o, _mm_add_ps(a, m));
  for (int n = 0; n < 4; ++n) out[n * stride] = o[n];
}

// R consecutive rows of a quantized input (int8 q, per-block d and ds; K values and nb blocks a row) from row n0 on,
// and each row's four float chains (acc[r], mins[r]: a chain per lane), summed by sum_chains into out[r * stride].
template <int R>
struct RowChains {
  const int8_t* x;
  const float *d, *ds;
  __m128 acc[R], mins[R];
  RowChains(const int8_t* q, const float* d_all, const float* ds_all, int64_t n0, int64_t K, int64_t nb)
      : x(q + n0 * K), d(d_all + n0 * nb), ds(ds_all + n0 * nb) {
    for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps(), mins[r] = _mm_setzero_ps();
  }
  void store(float* out, int64_t stride) const {
    for (int r = 0; r < R; ++r) out[r * stride] = sum_chains(acc[r], mins[r]);
  }
};
#endif

#if defined(__AVX2__)
// The 32 weights of a 4-bit block as unsigned bytes in order 0..31.
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}

// 16 in byte i where bit i of the 32 bits at qh is set, else 0: byte i takes byte i / 8 of qh (every 128-bit lane
// holds all four), then keeps its bit i % 8.
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}
#endif

// The constant term a weight block adds per unit of the input block's sum: m (q4_1, q5_1), -8 d (q4_0), -16 d (q5_0),
// 0 (q8_0).
template <int F>
inline float block_min(const uint8_t* blk, float dw) {
  if constexpr (F == Q8_0) return 0.0f;
  if constexpr (has_min(F)) return half_at(blk + 2);
  return -q_offset(F) * dw;
}

}  // namespace gqa_blocks
