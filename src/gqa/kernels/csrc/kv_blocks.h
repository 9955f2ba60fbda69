// A quantized KV cache's rows (gqa.cache.kv_dtypes): each head's D values of a token as D / 32 blocks of llama.cpp's
// q8_0 (an fp16 scale d, then 32 int8 q: 34 bytes) or q4_0 (d, then 16 bytes of 4-bit q, value j in the low nibble
// of byte j and value 16 + j in its high one: 18 bytes), x = d * q or d * (q - 8). A row is quantized once, when its
// token is written (llama.cpp's reference rounding, so the bytes equal gguf.quants' and llama.cpp's), and read by the
// attention a chunk of keys at a time into float32 scratch that stays in L1: the dequantized values are exact (an
// fp16 scale times a small integer), so attention over them is attention over the cache's own values.
#pragma once
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "blocks.h"
#include "simd.h"

namespace gqa_cpu {

constexpr int64_t KV_Q8_0 = 0, KV_Q4_0 = 1;  // the block formats' codes, as the quantized weights number them
constexpr int64_t KV_BLOCK = 32;

inline int64_t kv_block_bytes(int64_t format) { return format == KV_Q8_0 ? 34 : 18; }

// A quantized K row is stored rotated: k H, H the orthonormal Walsh-Hadamard matrix of size r (the largest power of
// two <= 256 that divides D; block-diagonal over D / r such blocks), and the queries are rotated the same way, so
// that q k^T = (q H)(k H)^T while a channel of outsized keys (RoPE'd K has a few) is spread over r values before the
// 32-value blocks take their scale from its largest. SmolLM2, q4_0 K/V, 2k tokens: perplexity +21% unrotated, +7.6%
// rotated (llama.cpp rotates quantized K the same way). H is its own inverse.
inline int64_t kv_rotation_size(int64_t D) {
  int64_t r = 1;
  while (r < 256 && D % (2 * r) == 0) r *= 2;
  return r;
}

// x[0:D] = x H in place: butterflies of widths 1, 2, 4, ... r / 2 over each r-value block, then the 1 / sqrt(r)
// scale (float32 as cache.quantize.rotate computes it, so that both give the same bits).
inline void rotate_kv_row(float* x, int64_t D) {
  const int64_t r = kv_rotation_size(D);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(r)));
  for (int64_t base = 0; base < D; base += r) {
    float* y = x + base;
    for (int64_t h = 1; h < r; h *= 2)
      for (int64_t i = 0; i < r; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const float a = y[j], b = y[j + h];
          y[j] = a + b, y[j + h] = a - b;
        }
    for (int64_t j = 0; j < r; ++j) y[j] *= scale;
  }
}
inline bool kv_format_known(int64_t format) { return format == KV_Q8_0 || format == KV_Q4_0; }
// Bytes of one head's row of D values (D a multiple of 32).
inline int64_t kv_row_bytes(int64_t format, int64_t D) { return D / KV_BLOCK * kv_block_bytes(format); }

__attribute__((always_inline)) inline float kv_half(const uint8_t* p) { return gqa_blocks::half_at(p); }  // F16C where there is one
inline void kv_store_half(uint8_t* p, float x) {
  const uint16_t h = c10::detail::fp16_ieee_from_fp32_value(x);
  std::memcpy(p, &h, 2);
}

// One row of D floats (D % 32 == 0) into `out` (kv_row_bytes). A block with a NaN or an infinity gets a NaN scale:
// its values read back as NaN, as a float cache would hold them, never as numbers.
inline void quantize_kv_row(const float* x, int64_t D, int64_t format, uint8_t* out) {
  for (int64_t b = 0; b < D / KV_BLOCK; ++b, x += KV_BLOCK) {
    uint8_t* blk = out + b * kv_block_bytes(format);
    bool finite = true;
    for (int64_t j = 0; j < KV_BLOCK; ++j) finite = finite && std::isfinite(x[j]);
    if (format == KV_Q8_0) {
      float amax = 0.0f;
      for (int64_t j = 0; j < KV_BLOCK; ++j) amax = std::max(amax, std::fabs(x[j]));
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      kv_store_half(blk, finite ? d : NAN);
      for (int64_t j = 0; j < KV_BLOCK; ++j)
        blk[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(finite ? std::round(x[j] * id) : 0.0f));
    } else {
      float amax = 0.0f, max = 0.0f;  // the value of largest magnitude, its sign kept (the first of equals)
      for (int64_t j = 0; j < KV_BLOCK; ++j)
        if (amax < std::fabs(x[j])) amax = std::fabs(x[j]), max = x[j];
      const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      kv_store_half(blk, finite ? d : NAN);
      for (int64_t j = 0; j < KV_BLOCK / 2; ++j) {
        const int lo = finite ? std::min(15, static_cast<int>(static_cast<int8_t>(x[j] * id + 8.5f))) : 8;
        const int hi = finite ? std::min(15, static_cast<int>(static_cast<int8_t>(x[j + 16] * id + 8.5f))) : 8;
        blk[2 + j] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
}

#if GQA_SIMD == 16
// The 32 values of one block (at `blk`) as two vectors of floats d * q: exact (an fp16 scale times an integer of at
// most 8 bits fits a float's 24-bit significand), so every reader of a row gets the same floats.
// (always inlined: a call per block of the value loop, through the PLT, cost the quantized-V step a third of its time)
__attribute__((always_inline)) inline void kv_block_values(const uint8_t* blk, int64_t format, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(kv_half(blk));
  const uint8_t* qs = blk + 2;
  if (format == KV_Q8_0) {
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)))));
    return;
  }
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), m = _mm_set1_epi8(0x0F);
  const __m512i eight = _mm512_set1_epi32(8);
  lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(q, m)), eight)));
  hi = _mm512_mul_ps(
      d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m)), eight)));
}

inline void kv_block_values(const uint8_t* blk, int64_t format, float* out, float* out_hi) {
  __m512 lo, hi;
  kv_block_values(blk, format, lo, hi);
  _mm512_storeu_ps(out, lo);
  _mm512_storeu_ps(out_hi, hi);
}
#endif

// Row `row` (kv_row_bytes(format, D) bytes) as D floats.
inline void dequantize_kv_row(const uint8_t* row, int64_t D, int64_t format, float* out) {
  using namespace gqa_simd;
  const int64_t bb = kv_block_bytes(format);
  for (int64_t b = 0; b < D / KV_BLOCK; ++b, out += KV_BLOCK) {
    const uint8_t* blk = row + b * bb;
#if GQA_SIMD == 16
    kv_block_values(blk, format, out, out + 16);
#else
    const float d = kv_half(blk);
    const uint8_t* qs = blk + 2;
#endif
#if GQA_SIMD == 8
    const __m256 vd = _mm256_set1_ps(d);
    if (format == KV_Q8_0) {
      for (int i = 0; i < 4; ++i) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i));
        _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
      }
    } else {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), m = _mm_set1_epi8(0x0F);
      const __m256i eight = _mm256_set1_epi32(8);
      const __m128i halves[2] = {_mm_and_si128(q, m), _mm_and_si128(_mm_srli_epi16(q, 4), m)};
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) {
          const __m128i part = j == 0 ? halves[i] : _mm_srli_si128(halves[i], 8);
          const __m256i v = _mm256_sub_epi32(_mm256_cvtepu8_epi32(part), eight);
          _mm256_storeu_ps(out + 16 * i + 8 * j, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(v)));
        }
    }
#elif GQA_SIMD == 1
    if (format == KV_Q8_0) {
      for (int64_t j = 0; j < KV_BLOCK; ++j) out[j] = d * static_cast<float>(static_cast<int8_t>(qs[j]));
    } else {
      for (int64_t j = 0; j < KV_BLOCK / 2; ++j) {
        out[j] = d * static_cast<float>((qs[j] & 0x0F) - 8);
        out[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
      }
    }
#endif
  }
}

}  // namespace gqa_cpu
