// llama.cpp's K formats, kept as they are in the file: a row of K values is K / 256 super-blocks, each eight
// sub-blocks of 32 values (quantized.cpp's blocks of the input line up with the sub-blocks):
//   q4_k (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc_j and mins m_j, 128 bytes of nibbles
//                     w = d * sc_j * q - dmin * m_j                       q in 0..15
//   q5_k (176 bytes): fp16 d, fp16 dmin, 12 bytes of scales and mins, 32 bytes of fifth bits, 128 bytes of nibbles
//                     w = d * sc_j * q - dmin * m_j                       q in 0..31
//   q6_k (210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales (one per 16 values),
//                     fp16 d                    w = d * sc_k * (q - 32)   q in 0..63
// Nibbles (q4_k, q5_k): the 32 bytes of sub-blocks 2i and 2i + 1 hold sub-block 2i in their low and 2i + 1 in their
// high 4 bits; q5_k's fifth bit of value l of sub-block j is bit j of byte l of the fifth bits. q6_k: sub-block
// j = 4h + p takes its low 4 bits from bytes 64h + 32(p % 2) + l (the high nibble when p >= 2) and its high 2 bits
// from bits 2p, 2p + 1 of byte 128 + 32h + l.
//
// A sub-block's dot product with an input block of 32 int8 q_x (scale d_x, sum of the block ds_x = d_x * sum q_x) is
//   q4_k, q5_k: (d * sc_j) * d_x * (q . q_x) - (dmin * m_j) * ds_x
//   q6_k:       d * d_x * (sc_2j * (q - 32)[0:16] . q_x[0:16] + sc_2j+1 * (q - 32)[16:32] . q_x[16:32])
// with exact integer dot products (|.| < 2^24), in the four chains quantized.cpp's formats use, so a row's sum does
// not depend on the other rows of the batch.
#pragma once

#include <cmath>
#include <cstring>

#include "blocks.h"
#include "quantized.h"

namespace gqa_blocks {

// Per sub-block j of one super-block: the factor on its integer dot product and its constant term per unit of
// the input block's sum (q4_k, q5_k: d * sc_j and -(dmin * m_j); q6_k: d and 0).
struct SuperScales {
  alignas(32) float dw[8];
  alignas(32) float mw[8];
};

// q4_k's and q5_k's 6-bit scale and min of sub-block j, packed in 12 bytes as llama.cpp's get_scale_min_k4.
inline void scale_min(const uint8_t* q, int j, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63, m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

template <int F>
inline SuperScales super_scales(const uint8_t* sb) {
  SuperScales s;
  if constexpr (F == Q6_K) {
    const float d = half_at(sb + 208);
    for (int j = 0; j < 8; ++j) s.dw[j] = d, s.mw[j] = 0.0f;
  } else {
    const float d = half_at(sb), dmin = half_at(sb + 2);
#if defined(__AVX2__)
    // The eight scales, then the eight mins, as bytes, unpacked from the 12 bytes u0 u1 u2 in vector registers (the
    // bit-twiddling in general registers cost a third of a one-row q4_k product): sc0-3 = u0 & 63, m0-3 = u1 & 63,
    // sc4-7 = (u2 & 15) | (u0 >> 6) << 4, m4-7 = (u2 >> 4) | (u1 >> 6) << 4, byte by byte.
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 4));  // u0 u1 u2, 4 bytes of nibbles
    const __m128i low6 = _mm_and_si128(v, _mm_set1_epi8(0x3F));                      // sc0-3, m0-3
    const __m128i top2 = _mm_and_si128(_mm_srli_epi16(v, 2), _mm_set1_epi8(0x30));   // their bits 6-7 at 4-5
    const __m128i u2 = _mm_shuffle_epi32(v, 0xAA), low4 = _mm_set1_epi8(0x0F);
    const __m128i sc47 = _mm_or_si128(_mm_and_si128(u2, low4), top2);                        // dword 0
    const __m128i m47 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(u2, 4), low4), top2);      // dword 1
    const __m128i bytes = _mm_blend_epi32(_mm_unpacklo_epi32(low6, sc47), _mm_shuffle_epi32(m47, 0x55), 0x8);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
    _mm256_store_ps(s.dw, _mm256_mul_ps(_mm256_set1_ps(d), sc));
    _mm256_store_ps(s.mw, _mm256_mul_ps(_mm256_set1_ps(-dmin), m));  // -(dmin * m), bit for bit
#else
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min(sb + 4, j, sc, m);
      s.dw[j] = d * static_cast<float>(sc), s.mw[j] = -dmin * static_cast<float>(m);
    }
#endif
  }
  return s;
}

// q of value l of sub-block j: unsigned (q4_k, q5_k) or q - 32 (q6_k).
inline int32_t k_q(const uint8_t* sb, int64_t format, int j, int l) {
  if (format == Q6_K) {
    const int h = j / 4, p = j % 4;
    const int low = (sb[64 * h + 32 * (p % 2) + l] >> (p >= 2 ? 4 : 0)) & 0x0F;
    const int high = (sb[128 + 32 * h + l] >> (2 * p)) & 3;
    return (low | high << 4) - 32;
  }
  const uint8_t byte = sb[(format == Q4_K ? 16 : 48) + 32 * (j / 2) + l];
  int32_t q = j % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
  if (format == Q5_K) q |= ((sb[16 + l] >> j) & 1) << 4;
  return q;
}

// The 32 float weights of sub-block j of super-block sb, as llama.cpp's dequantize_row_q*_K computes them.
inline void k_weights(const uint8_t* sb, int64_t format, int j, float* out) {
  if (format == Q6_K) {
    const float d = half_at(sb + 208);
    for (int l = 0; l < 32; ++l) {
      const float sc = static_cast<float>(static_cast<int8_t>(sb[192 + 2 * j + l / 16]));
      out[l] = d * sc * static_cast<float>(k_q(sb, format, j, l));
    }
    return;
  }
  int sc, m;
  scale_min(sb + 4, j, sc, m);
  const float dw = half_at(sb) * static_cast<float>(sc), mw = half_at(sb + 2) * static_cast<float>(m);
  for (int l = 0; l < 32; ++l) out[l] = dw * static_cast<float>(k_q(sb, format, j, l)) - mw;
}

#if defined(__AVX2__)
// Sub-blocks j0 .. j0 + 3 (j0 = 0 or 4) of super-block sb: their 32 q each as bytes in order — unsigned (q4_k, q5_k)
// or q - 32 (q6_k, signed) — and, q6_k only, each one's two int8 scales as int16, eight lanes each (bytes 0-15, then
// 16-31). Every shift is an immediate on 16-bit lanes whose spill into the next byte the mask drops.
template <int F>
inline void k_quad(const uint8_t* sb, int j0, __m256i* w, __m256i* scales) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (F == Q6_K) {
    const int h = j0 / 4;
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * h));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * h + 32));
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * h));
    const __m256i bits45 = _mm256_set1_epi8(0x30), offset = _mm256_set1_epi8(32);
    w[0] = _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi16(high, 4), bits45));
    w[1] = _mm256_or_si256(_mm256_and_si256(b, low4), _mm256_and_si256(_mm256_slli_epi16(high, 2), bits45));
    w[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4), _mm256_and_si256(high, bits45));
    w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(high, 2), bits45));
    // the half's eight scales as int16 in both 128-bit lanes; sub-block p takes scale 2p (low lane), 2p + 1 (high)
    int64_t bytes;
    std::memcpy(&bytes, sb + 192 + 8 * h, 8);
    const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_cvtsi64_si128(bytes)));
    for (int p = 0; p < 4; ++p) {
      w[p] = _mm256_sub_epi8(w[p], offset);
      const char lo = static_cast<char>(4 * p), hi = static_cast<char>(4 * p + 2);  // the int16's bytes
      scales[p] = _mm256_shuffle_epi8(sc, _mm256_setr_epi8(lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1,
                                                           lo, lo + 1, lo, lo + 1, lo, lo + 1, hi, hi + 1, hi, hi + 1,
                                                           hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1,
                                                           hi, hi + 1));
    }
  } else {
    const uint8_t* qs = sb + (F == Q4_K ? 16 : 48) + 16 * j0;  // sub-blocks j0, j0 + 1 share 32 bytes
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32));
    w[0] = _mm256_and_si256(a, low4), w[1] = _mm256_and_si256(_mm256_srli_epi16(a, 4), low4);
    w[2] = _mm256_and_si256(b, low4), w[3] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    if constexpr (F == Q5_K) {  // bit j of the fifth-bit bytes to bit 4 (value 16)
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16)), bit4 = _mm256_set1_epi8(16);
      if (j0 == 0) {
        w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
        w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit4));
        w[2] = _mm256_or_si256(w[2], _mm256_and_si256(_mm256_slli_epi16(qh, 2), bit4));
        w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_slli_epi16(qh, 1), bit4));
      } else {
        w[0] = _mm256_or_si256(w[0], _mm256_and_si256(qh, bit4));
        w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_srli_epi16(qh, 1), bit4));
        w[2] = _mm256_or_si256(w[2], _mm256_and_si256(_mm256_srli_epi16(qh, 2), bit4));
        w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_srli_epi16(qh, 3), bit4));
      }
    }
  }
}

// 8 int32 lanes summing to the sub-block's integer dot product with 32 int8 inputs at xq (q6_k: scales included).
template <int F>
inline __m256i k_sub_dot(__m256i w, __m256i scales, const int8_t* xq) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  if constexpr (F == Q6_K) {  // |q - 32| * |x| pairs <= 2 * 32 * 127: no saturation in maddubs
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), scales);
  } else {
    return dot_u8s8(w, x);
  }
}

// out[n * stride] for rows n0 .. n0 + 3 of x and one weight row w of nb / 8 super-blocks (quantized.cpp's dot4).
template <int F>
inline void kdot4(const uint8_t* w, int64_t nb, const gqa::QuantizedRows& xr, int64_t n0, int64_t K, float* out,
                  int64_t stride) {
  constexpr int64_t BYTES = block_bytes_of(F);
  __m128 acc[4], mins[4];
  for (int c = 0; c < 4; ++c) acc[c] = _mm_setzero_ps(), mins[c] = _mm_setzero_ps();
  const int8_t* x = xr.q.data() + n0 * K;
  const float *dt = xr.dt.data() + n0, *dst = xr.dst.data() + n0;
  for (int64_t s = 0; s < nb / 8; ++s) {
    const uint8_t* sb = w + s * BYTES;
    prefetch_ahead(sb, BYTES);
    const SuperScales sc = super_scales<F>(sb);
    for (int j0 = 0; j0 < 8; j0 += 4) {
      __m256i wq[4], scales[4];
      k_quad<F>(sb, j0, wq, scales);
      for (int i = 0; i < 4; ++i) {
        const int64_t b = s * 8 + j0 + i;
        const int8_t* xb = x + b * QK;
        const __m128i dots = sum4(k_sub_dot<F>(wq[i], scales[i], xb), k_sub_dot<F>(wq[i], scales[i], xb + K),
                                  k_sub_dot<F>(wq[i], scales[i], xb + 2 * K), k_sub_dot<F>(wq[i], scales[i], xb + 3 * K));
        const __m128 scale = _mm_mul_ps(_mm_set1_ps(sc.dw[j0 + i]), _mm_loadu_ps(dt + b * xr.n4));
        acc[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(dots), scale, acc[i]);
        if constexpr (F != Q6_K)
          mins[i] = _mm_fmadd_ps(_mm_set1_ps(sc.mw[j0 + i]), _mm_loadu_ps(dst + b * xr.n4), mins[i]);
      }
    }
  }
  store_chains4(acc, mins, out, stride);
}

// The 256 float weights of super-block sb, k_weights' values for every sub-block, eight lanes at a time (a prompt's
// products dequantize every matrix: this is most of a short prompt's time).
template <int F>
inline void k_super_weights(const uint8_t* sb, float* out) {
  const SuperScales sc = super_scales<F>(sb);
  alignas(32) float group[16];  // q6_k: d * sc_k per 16 values
  if constexpr (F == Q6_K)
    for (int k = 0; k < 16; ++k) group[k] = sc.dw[0] * static_cast<float>(static_cast<int8_t>(sb[192 + k]));
  for (int j0 = 0; j0 < 8; j0 += 4) {
    __m256i wq[4], scales[4];
    k_quad<F>(sb, j0, wq, scales);
    for (int i = 0; i < 4; ++i) {
      alignas(32) int8_t q[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), wq[i]);
      const int j = j0 + i;
      for (int l = 0; l < 32; l += 8) {
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<__m128i*>(q + l))));
        const __m256 w = F == Q6_K ? _mm256_mul_ps(_mm256_set1_ps(group[2 * j + l / 16]), v)
                                   : _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(sc.dw[j]), v), _mm256_set1_ps(sc.mw[j]));
        _mm256_storeu_ps(out + 32 * j + l, w);
      }
    }
  }
}

#if defined(GQA_ZMM_DOTS)
// Sub-blocks 2k and 2k + 1 (k = 0..3) of super-block sb as 64 unsigned bytes in order: q (q4_k, q5_k; 0..31), or q6_k's
// q before the offset 32 is taken (0..63). Shifts on 16-bit lanes by a count per half (the first 32 bytes, the last),
// whose spill into the next byte the masks drop, as k_quad's.
template <int F>
inline __m512i k_pair(const uint8_t* sb, int k) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const auto counts = [](int16_t first, int16_t second) {
    return _mm512_inserti64x4(_mm512_set1_epi16(first), _mm256_set1_epi16(second), 1);
  };
  if constexpr (F == Q6_K) {  // k even: p = 0, 1 of half h = k / 2 (low nibbles); k odd: p = 2, 3 (high nibbles)
    const __m512i ab = _mm512_loadu_si512(sb + 64 * (k / 2));
    const __m256i high_bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * (k / 2)));
    const __m512i high = _mm512_broadcast_i64x4(high_bytes);
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    if (k % 2 == 0)  // high bits 2p, 2p + 1 to bits 4, 5
      return _mm512_or_si512(_mm512_and_si512(ab, low4),
                             _mm512_and_si512(_mm512_sllv_epi16(high, counts(4, 2)), bits45));
    return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ab, 4), low4),
                           _mm512_and_si512(_mm512_srlv_epi16(high, counts(0, 2)), bits45));
  } else {
    const uint8_t* qs = sb + (F == Q4_K ? 16 : 48) + 32 * k;  // sub-block 2k in the low nibbles, 2k + 1 in the high
    const __m512i a = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)));
    const __m512i q = _mm512_and_si512(_mm512_srlv_epi16(a, counts(0, 4)), low4);
    if constexpr (F == Q4_K) return q;
    // q5_k: bit 2k (then 2k + 1) of the fifth-bit bytes to bit 4
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16)));
    const __m512i bit = k < 2 ? _mm512_sllv_epi16(qh, counts(4 - 2 * k, 3 - 2 * k))
                              : _mm512_srlv_epi16(qh, counts(2 * k - 4, 2 * k - 3));
    return _mm512_or_si512(q, _mm512_and_si512(bit, _mm512_set1_epi8(16)));
  }
}

// 16 int32 lanes, 8 summing to sub-block 2k's integer dot product with the 32 inputs at xq and 8 to sub-block
// 2k + 1's with the next 32 (q6_k: each 16 values' (q - 32) . x times its scale; sc: the super-block's 16 scales);
// q: the pair's weights (k_pair).
template <int F>
inline __m512i k_pair_dot(__m512i q, int k, const int8_t* xq, __m512i sc) {
  const __m512i x = _mm512_loadu_si512(xq), zero = _mm512_setzero_si512();
  const __m512i dots = _mm512_dpbusd_epi32(zero, q, x);
  if constexpr (F != Q6_K) return dots;
  const __m512i offset = _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(32), x);  // 4 lanes per 16 values
  const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // each scale's 4 lanes
  const __m512i scales = _mm512_permutexvar_epi32(_mm512_add_epi32(_mm512_set1_epi32(4 * k), lanes), sc);
  return _mm512_mullo_epi32(_mm512_sub_epi32(dots, offset), scales);
}

template <int F>
inline __m512i k_pair_dot(const uint8_t* sb, int k, const int8_t* xq, __m512i sc) {
  return k_pair_dot<F>(k_pair<F>(sb, k), k, xq, sc);
}
#endif

// Row n of x and one weight row w: per super-block its eight sub-blocks' integer sums, from four 512-bit products of
// two sub-blocks each (AVX-512 VNNI: 1.4x the speed) or from two steps of four 256-bit ones, then the float steps of
// four sub-blocks at a time (a chain per lane), in the same order either way.
template <int F>
inline float kdot1(const uint8_t* w, int64_t nb, const gqa::QuantizedRows& xr, int64_t n, int64_t K) {
  constexpr int64_t BYTES = block_bytes_of(F);
  const int8_t* x = xr.q.data() + n * K;
  const float *d = xr.d.data() + n * (K / QK), *ds = xr.ds.data() + n * (K / QK);
  __m128 acc = _mm_setzero_ps(), mins = _mm_setzero_ps();
  for (int64_t s = 0; s < nb / 8; ++s) {
    const uint8_t* sb = w + s * BYTES;
    prefetch_ahead(sb, BYTES);
    const SuperScales sc = super_scales<F>(sb);
    const int64_t b = s * 8;
    __m128i sums[2];  // sub-blocks 0-3, 4-7
#if defined(GQA_ZMM_DOTS)
    const __m512i sc16 = F == Q6_K ? _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192)))
                                   : _mm512_setzero_si512();
    const __m256i all = sum8_pairs(k_pair_dot<F>(sb, 0, x + b * QK, sc16), k_pair_dot<F>(sb, 1, x + (b + 2) * QK, sc16),
                                   k_pair_dot<F>(sb, 2, x + (b + 4) * QK, sc16),
                                   k_pair_dot<F>(sb, 3, x + (b + 6) * QK, sc16));
    sums[0] = _mm256_castsi256_si128(all), sums[1] = _mm256_extracti128_si256(all, 1);
#else
    for (int j = 0; j < 8; j += 4) {
      __m256i wq[4], scales[4], dots[4];
      k_quad<F>(sb, j, wq, scales);
      for (int i = 0; i < 4; ++i) dots[i] = k_sub_dot<F>(wq[i], scales[i], x + (b + j + i) * QK);
      sums[j / 4] = sum4(dots[0], dots[1], dots[2], dots[3]);
    }
#endif
    for (int j = 0; j < 8; j += 4) {
      const __m128 scale = _mm_mul_ps(_mm_load_ps(sc.dw + j), _mm_loadu_ps(d + b + j));
      acc = _mm_fmadd_ps(_mm_cvtepi32_ps(sums[j / 4]), scale, acc);
      if constexpr (F != Q6_K) mins = _mm_fmadd_ps(_mm_load_ps(sc.mw + j), _mm_loadu_ps(ds + b + j), mins);
    }
  }
  return sum_chains(acc, mins);
}

// Rows n0 .. n0 + R - 1 (R = 2, 3) of x and one weight row w, into out[r * stride]: each row's kdot1, the same
// operations in the same order, each super-block's scales and q unpacked once for the R rows.
template <int F, int R>
inline void kdot_rows(const uint8_t* w, int64_t nb, const gqa::QuantizedRows& xr, int64_t n0, int64_t K, float* out,
                      int64_t stride) {
  constexpr int64_t BYTES = block_bytes_of(F);
  RowChains<R> c(xr.q.data(), xr.d.data(), xr.ds.data(), n0, K, nb);
  const int8_t* x = c.x;
  for (int64_t s = 0; s < nb / 8; ++s) {
    const uint8_t* sb = w + s * BYTES;
    prefetch_ahead(sb, BYTES);
    const SuperScales sc = super_scales<F>(sb);
    const int64_t b = s * 8;
    __m128i sums[R][2];  // per row: sub-blocks 0-3, 4-7
#if defined(GQA_ZMM_DOTS)
    const __m512i sc16 = F == Q6_K ? _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192)))
                                   : _mm512_setzero_si512();
    const __m512i q[4] = {k_pair<F>(sb, 0), k_pair<F>(sb, 1), k_pair<F>(sb, 2), k_pair<F>(sb, 3)};
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = x + r * K + b * QK;
      const __m256i all = sum8_pairs(k_pair_dot<F>(q[0], 0, xb, sc16), k_pair_dot<F>(q[1], 1, xb + 2 * QK, sc16),
                                     k_pair_dot<F>(q[2], 2, xb + 4 * QK, sc16),
                                     k_pair_dot<F>(q[3], 3, xb + 6 * QK, sc16));
      sums[r][0] = _mm256_castsi256_si128(all), sums[r][1] = _mm256_extracti128_si256(all, 1);
    }
#else
    for (int j = 0; j < 8; j += 4) {
      __m256i wq[4], scales[4];
      k_quad<F>(sb, j, wq, scales);
      for (int r = 0; r < R; ++r) {
        __m256i dots[4];
        for (int i = 0; i < 4; ++i) dots[i] = k_sub_dot<F>(wq[i], scales[i], x + r * K + (b + j + i) * QK);
        sums[r][j / 4] = sum4(dots[0], dots[1], dots[2], dots[3]);
      }
    }
#endif
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 8; j += 4) {
        const __m128 scale = _mm_mul_ps(_mm_load_ps(sc.dw + j), _mm_loadu_ps(c.d + r * nb + b + j));
        c.acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums[r][j / 4]), scale, c.acc[r]);
        if constexpr (F != Q6_K)
          c.mins[r] = _mm_fmadd_ps(_mm_load_ps(sc.mw + j), _mm_loadu_ps(c.ds + r * nb + b + j), c.mins[r]);
      }
  }
  c.store(out, stride);
}
#else
// The same sums in scalar code.
template <int F>
inline float kdot1(const uint8_t* w, int64_t nb, const gqa::QuantizedRows& xr, int64_t n, int64_t K) {
  constexpr int64_t BYTES = block_bytes_of(F);
  const int8_t* x = xr.q.data() + n * K;
  const float *d = xr.d.data() + n * (K / QK), *ds = xr.ds.data() + n * (K / QK);
  float acc[4] = {}, mins[4] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* sb = w + b / 8 * BYTES;
    const int j = static_cast<int>(b % 8);
    const SuperScales sc = super_scales<F>(sb);
    int32_t dot = 0;
    for (int l = 0; l < 32; ++l) {
      const int32_t scale = F == Q6_K ? static_cast<int8_t>(sb[192 + 2 * j + l / 16]) : 1;
      dot += scale * k_q(sb, F, j, l) * x[b * QK + l];
    }
    acc[b & 3] = std::fma(static_cast<float>(dot), sc.dw[j] * d[b], acc[b & 3]);
    if constexpr (F != Q6_K) mins[b & 3] = std::fma(sc.mw[j], ds[b], mins[b & 3]);
  }
  return ((acc[0] + acc[2]) + (acc[1] + acc[3])) + ((mins[0] + mins[2]) + (mins[1] + mins[3]));
}
#endif

}  // namespace gqa_blocks
