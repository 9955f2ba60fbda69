// Grouped decode attention (gqa::decode_attention, and the attention of gqa::decode_attend and the one-call step):
// the R = G * L query rows of a KV head read each key and value row once, online softmax in float32, the context cut
// into splits so that several threads stream even one head; a split's partial result (running max, sum, accumulator
// per row) is combined per row afterwards.
#pragma once
#include "kv_blocks.h"
#include "simd.h"

#if GQA_SIMD > 1
#include <cpuid.h>
#endif
#include <cstring>

namespace gqa_cpu {

using namespace gqa_simd;


constexpr int64_t CHUNK = 64;  // keys per online-softmax step: the chunk's K/V rows stay in L1
constexpr int64_t ROW_TILE = 4;         // query rows that share each loaded value row
constexpr int64_t PREFETCH_CHUNKS = 2;  // K/V rows this many chunks ahead are prefetched
constexpr int64_t PAGED_SPAN = 256;     // keys per split of a paged cache

// Whether to prefetch the K/V rows ahead in software. Measured both ways: on Intel (Sapphire Rapids) the hardware
// prefetcher alone left bandwidth unused; on AMD (Zen 4) the software prefetches stall the loop instead (bf16 decode
// attention, SmolLM2's heads, 4096 keys x 30 layers, 2 threads: 7.0 ms with them, 4.5 ms without; the whole-model
// decode at 4k tokens of context 84 -> 102 tok/s).
inline bool prefetch_kv_rows() {
#if GQA_SIMD > 1
  static const bool yes = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return true;
    char vendor[13] = {};
    std::memcpy(vendor, &ebx, 4), std::memcpy(vendor + 4, &edx, 4), std::memcpy(vendor + 8, &ecx, 4);
    return std::strcmp(vendor, "AuthenticAMD") != 0;
  }();
  return yes;
#else
  return false;
#endif
}

inline void to_float_row(const BFloat16* x, float* y, int64_t n) {
  int64_t i = 0;
#if GQA_SIMD > 1
  for (; i + LANES <= n; i += LANES) vstore(y + i, vload(x + i));
#endif
  for (; i < n; ++i) y[i] = to_float(x[i]);
}
inline void to_float_row(const float* x, float* y, int64_t n) { std::copy(x, x + n, y); }

// s[c] = q . k[c] for the n (<= CHUNK) keys of a chunk; k rows are float32 here (bf16 chunks are converted first).
inline void chunk_scores(const float* q, const float* k, int64_t sk, int64_t n, int64_t D, float* s) {
  int64_t c = 0;
#if GQA_SIMD > 1
  if (D % LANES == 0) {
    for (; c + LANES <= n; c += LANES) {  // LANES keys at a time, one accumulator each
      vec acc[LANES];
      for (int i = 0; i < LANES; ++i) acc[i] = vzero();
      for (int64_t d = 0; d < D; d += LANES) {
        const vec qd = vload(q + d);
        for (int i = 0; i < LANES; ++i) acc[i] = vfma(qd, vload(k + (c + i) * sk + d), acc[i]);
      }
      vstore(s + c, reduce_lanes(acc));
    }
  }
#endif
  for (; c < n; ++c) {
    float acc = 0.0f;
    for (int64_t d = 0; d < D; ++d) acc += q[d] * k[c * sk + d];
    s[c] = acc;
  }
}

#if defined(__AVX512BF16__)
// bfloat16 keys and query: s[c] = scale * (q . k[c]) with vdpbf16ps (32 products per instruction, exact products,
// float32 sums), straight from the cache's bf16 rows. Needs D % 32 == 0.
inline void chunk_scores_bf16(const BFloat16* q, const BFloat16* k, int64_t sk, int64_t n, int64_t D, float scale,
                              float* s) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {  // a constant 16 keys: the accumulators stay in registers
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh qd = (__m512bh)_mm512_loadu_si512(q + d);
      for (int i = 0; i < 16; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], qd, (__m512bh)_mm512_loadu_si512(k + (c + i) * sk + d));
    }
    _mm512_storeu_ps(s + c, _mm512_mul_ps(reduce_lanes(acc), _mm512_set1_ps(scale)));
  }
  if (c < n) {  // the last 1-15 keys, the same operations
    const int64_t m = n - c;
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh qd = (__m512bh)_mm512_loadu_si512(q + d);
      for (int i = 0; i < m; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], qd, (__m512bh)_mm512_loadu_si512(k + (c + i) * sk + d));
    }
    const __m512 r = _mm512_mul_ps(reduce_lanes(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(s + c, static_cast<__mmask16>((1u << m) - 1u), r);
  }
}
#endif

#if GQA_SIMD == 16 && defined(__AVX512VNNI__)
// Quantized keys as integer dot products (vpdpwssd: 32 int16 x int16 products a instruction, summed exactly in int32):
// a bf16/fp16 query row is held as int16 per 32-value block with its own scale (amax / 32767: 2^-16 of the block's
// largest off at most, below the half-precision rounding the query already carries), a key block's int8 values (q8_0 q, q4_0 q - 8)
// are widened to int16, and q . k = sum_b dq_b dk_b sum_j q16_j k_j — the float path dequantized and multiplied every
// value instead (int8 -> int32 -> float, times the scale, then an FMA). Needs D % 32 == 0 (every quantized row is).
constexpr bool INT_KEYS = true;

// q[0:D] (finite) -> q16[0:D], dq[0:D / 32] with q[j] ~ dq[j / 32] * q16[j].
inline void quantize_query_int16(const float* q, int64_t D, int16_t* q16, float* dq) {
  for (int64_t b = 0; b < D / KV_BLOCK; ++b) {
    const __m512 lo = _mm512_loadu_ps(q + b * KV_BLOCK), hi = _mm512_loadu_ps(q + b * KV_BLOCK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vid)), c = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vid));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + b * KV_BLOCK), _mm512_cvtsepi32_epi16(a));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + b * KV_BLOCK + 16), _mm512_cvtsepi32_epi16(c));
    dq[b] = d;
  }
}

// The tiles hold a block's 32 values as 16 int32 lanes of two int16 each, in the order the bytes give them without
// a widening pass: tile t of a block pairs values (a_t, a_t + 2) — q8_0: a = 4p + e for dword p (4 bytes) of the
// block and e = 0 (its even bytes) or 1 (its odd ones), t = 2p + e; q4_0 (nibbles, byte j holding values j and
// 16 + j): a = 4p + e + 16h, h = 0 (low nibbles) or 1 (high ones), t = 4p + 2h + e, and q4_0's values are taken
// unsigned (q, not q - 8): the -8 goes into the sum's starting value, -8 * sum_j q16_j, so the integer sums are
// exactly those of q16 . (q - 8). pairs[b * 16 + t] is the query's (a_t, a_t + 2) as one int32 (the low half the
// first); offs[b] the block's starting value.
inline void query_pairs_int16(const int16_t* q16, int64_t D, int64_t format, int32_t* pairs, int32_t* offs) {
  auto pair = [](int16_t lo, int16_t hi) {
    return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(lo)) |
                                (static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16));
  };
  for (int64_t b = 0; b < D / KV_BLOCK; ++b) {
    const int16_t* q = q16 + b * KV_BLOCK;
    int32_t* out = pairs + b * 16;
    int32_t sum = 0;
    for (int j = 0; j < KV_BLOCK; ++j) sum += q[j];
    offs[b] = format == KV_Q4_0 ? -8 * sum : 0;
    for (int t = 0; t < 16; ++t) {
      const int a = format == KV_Q8_0 ? 4 * (t / 2) + t % 2 : 4 * (t / 4) + (t % 4) / 2 * 16 + t % 2;
      out[t] = pair(q[a], q[a + 2]);
    }
  }
}

// The n (<= CHUNK) keys of a chunk, rows[c] key c's row of blocks, as int16 tiles for chunk_scores_int16: per group
// of 16 keys and block b, 16 vectors whose lane i holds key i's pair t of values (query_pairs_int16's order) — keys
// along the lanes, so that a score needs no sum across lanes — at kt + ((g * nb + b) * 16 + t) * 16 int32; dk[b *
// CHUNK + c] the blocks' scales. Keys past n read as zeros (scale 0). The keys' dwords are brought along the lanes
// by unpacks of 32 and 64 bits and one 128-bit shuffle (q8_0: each vector first holds two keys' 32 bytes, q4_0 four
// keys' 16), then split into their even and odd bytes (q4_0: nibbles) as int16 by shifts and masks.
inline void key_tiles_int16(const uint8_t* const* rows, int64_t format, int64_t nb, int64_t n, int32_t* kt, float* dk) {
  static const uint8_t zeros[34] = {};
  const int64_t bb = kv_block_bytes(format);
  for (int64_t g = 0; g * 16 < n; ++g) {
    const int64_t m = std::min<int64_t>(16, n - g * 16);
    const uint8_t* key[16];
    for (int64_t i = 0; i < 16; ++i) key[i] = i < m ? rows[g * 16 + i] : zeros;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t off = b * bb;
      const auto at = [&](int64_t i) { return key[i] + (key[i] == zeros ? 0 : off); };
      alignas(32) uint16_t halves[16];
      for (int64_t i = 0; i < 16; ++i) std::memcpy(&halves[i], at(i), 2);
      _mm512_storeu_ps(dk + b * CHUNK + g * 16,
                       _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(halves))));
      int32_t* tile = kt + (g * nb + b) * 256;
      __m512i u[8];
      if (format == KV_Q8_0) {
        // z[i] = keys x | y (32 bytes each) with x, y chosen so that the unpacks leave keys 0..15 in order
        __m512i z[8], t[8];
        for (int i = 0; i < 8; ++i) {
          const int x = i < 4 ? i : i + 4, y = x + 4;
          z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at(x) + 2))),
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at(y) + 2)), 1);
        }
        for (int i = 0; i < 4; ++i) {
          t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
          t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
        }
        // v[j]: dword j' of 4 keys per 128-bit lane (j' = j for lanes 0, 2; j + 4 for lanes 1, 3)
        __m512i v[8];
        for (int i = 0; i < 2; ++i) {
          v[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
          v[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
          v[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
          v[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        for (int j = 0; j < 4; ++j) {
          u[j] = _mm512_shuffle_i32x4(v[j], v[j + 4], 0x88);      // dword j of keys 0..15
          u[j + 4] = _mm512_shuffle_i32x4(v[j], v[j + 4], 0xDD);  // dword j + 4
        }
        for (int p = 0; p < 8; ++p) {
          _mm512_storeu_si512(tile + (2 * p) * 16, _mm512_srai_epi16(_mm512_slli_epi16(u[p], 8), 8));
          _mm512_storeu_si512(tile + (2 * p + 1) * 16, _mm512_srai_epi16(u[p], 8));
        }
      } else {
        // z[i] = keys i, 4 + i, 8 + i, 12 + i (16 bytes each), then two rounds of unpacks: dword p of keys 0..15
        __m512i z[4], t[4];
        for (int i = 0; i < 4; ++i) {
          __m512i r = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at(i) + 2)));
          r = _mm512_inserti32x4(r, _mm_loadu_si128(reinterpret_cast<const __m128i*>(at(4 + i) + 2)), 1);
          r = _mm512_inserti32x4(r, _mm_loadu_si128(reinterpret_cast<const __m128i*>(at(8 + i) + 2)), 2);
          z[i] = _mm512_inserti32x4(r, _mm_loadu_si128(reinterpret_cast<const __m128i*>(at(12 + i) + 2)), 3);
        }
        t[0] = _mm512_unpacklo_epi32(z[0], z[1]), t[1] = _mm512_unpackhi_epi32(z[0], z[1]);
        t[2] = _mm512_unpacklo_epi32(z[2], z[3]), t[3] = _mm512_unpackhi_epi32(z[2], z[3]);
        u[0] = _mm512_unpacklo_epi64(t[0], t[2]), u[1] = _mm512_unpackhi_epi64(t[0], t[2]);
        u[2] = _mm512_unpacklo_epi64(t[1], t[3]), u[3] = _mm512_unpackhi_epi64(t[1], t[3]);
        const __m512i low4 = _mm512_set1_epi16(0x000F);
        for (int p = 0; p < 4; ++p) {
          _mm512_storeu_si512(tile + (4 * p) * 16, _mm512_and_si512(u[p], low4));
          _mm512_storeu_si512(tile + (4 * p + 1) * 16, _mm512_and_si512(_mm512_srli_epi16(u[p], 8), low4));
          _mm512_storeu_si512(tile + (4 * p + 2) * 16, _mm512_and_si512(_mm512_srli_epi16(u[p], 4), low4));
          _mm512_storeu_si512(tile + (4 * p + 3) * 16, _mm512_srli_epi16(u[p], 12));
        }
      }
    }
  }
}

// s[c] = sum_b dq[b] * dk[b * CHUNK + c] * (offs[b] + pairs_b . tiles_b[c]) for the n keys of key_tiles_int16's tiles
// `kt` (query_pairs_int16's pairs and starting values).
inline void chunk_scores_int16(const int32_t* pairs, const int32_t* offs, const float* dq, const int32_t* kt,
                               const float* dk, int64_t nb, int64_t n, float* s) {
  for (int64_t g = 0; g * 16 < n; ++g) {
    __m512 total = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const int32_t* tile = kt + (g * nb + b) * 256;
      __m512i part[4] = {_mm512_set1_epi32(offs[b]), _mm512_setzero_si512(), _mm512_setzero_si512(),
                         _mm512_setzero_si512()};
      for (int t = 0; t < 16; ++t)
        part[t % 4] = _mm512_dpwssd_epi32(part[t % 4], _mm512_loadu_si512(tile + t * 16),
                                          _mm512_set1_epi32(pairs[b * 16 + t]));
      const __m512i acc = _mm512_add_epi32(_mm512_add_epi32(part[0], part[1]), _mm512_add_epi32(part[2], part[3]));
      const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_loadu_ps(dk + b * CHUNK + g * 16));
      total = _mm512_fmadd_ps(scaled, _mm512_set1_ps(dq[b]), total);
    }
    const int64_t m = std::min<int64_t>(16, n - g * 16);
    _mm512_mask_storeu_ps(s + g * 16, static_cast<__mmask16>((1u << m) - 1u), total);
  }
}
#else
constexpr bool INT_KEYS = false;
#endif

#if GQA_SIMD > 1
// Value columns held in registers per row: RT x VALUE_VECS accumulators fit the register file (32 with AVX-512, 16
// with AVX2) next to the loaded value vectors.
constexpr int VALUE_VECS = GQA_SIMD == 16 ? 4 : 2;
#endif

// For RT rows: acc_r[0:Dv] = acc_r * alpha_r + sum_c p_r[c] v[c, :] over a chunk of n keys; each value row is
// loaded (and converted) once for the RT rows, VALUE_VECS * LANES columns at a time in registers.
template <typename T, int RT>
inline void accumulate_values(float* acc, int64_t lda, const float* alpha, const float* p, int64_t ldp, const T* v,
                              int64_t sv, int64_t n, int64_t Dv) {
  int64_t d = 0;
#if GQA_SIMD > 1
  constexpr int WIDE = VALUE_VECS * LANES;
  for (; d + WIDE <= Dv; d += WIDE) {
    vec a[RT][VALUE_VECS];
    for (int r = 0; r < RT; ++r) {
      const vec al = vset(alpha[r]);
      for (int j = 0; j < VALUE_VECS; ++j) a[r][j] = vmul(vload(acc + r * lda + d + LANES * j), al);
    }
    for (int64_t c = 0; c < n; ++c) {
      const T* vc = v + c * sv + d;
      vec vv[VALUE_VECS];
      for (int j = 0; j < VALUE_VECS; ++j) vv[j] = vload(vc + LANES * j);
      for (int r = 0; r < RT; ++r) {
        const vec pc = vset(p[r * ldp + c]);
        for (int j = 0; j < VALUE_VECS; ++j) a[r][j] = vfma(pc, vv[j], a[r][j]);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int j = 0; j < VALUE_VECS; ++j) vstore(acc + r * lda + d + LANES * j, a[r][j]);
  }
  for (; d + LANES <= Dv; d += LANES) {
    vec a[RT];
    for (int r = 0; r < RT; ++r) a[r] = vmul(vload(acc + r * lda + d), vset(alpha[r]));
    for (int64_t c = 0; c < n; ++c) {
      const vec vc = vload(v + c * sv + d);
      for (int r = 0; r < RT; ++r) a[r] = vfma(vset(p[r * ldp + c]), vc, a[r]);
    }
    for (int r = 0; r < RT; ++r) vstore(acc + r * lda + d, a[r]);
  }
#endif
  for (; d < Dv; ++d)
    for (int r = 0; r < RT; ++r) {
      float x = acc[r * lda + d] * alpha[r];
      for (int64_t c = 0; c < n; ++c) x += p[r * ldp + c] * to_float(v[c * sv + d]);
      acc[r * lda + d] = x;
    }
}

#if GQA_SIMD == 16
// accumulate_values over quantized value rows (kv_blocks.h; rows[c] is key c's row of blocks): each block dequantized
// in registers to the floats dequantize_kv_row writes and summed in the same order, so the same bits, without the
// round trip through a scratch buffer. Dv % 32 == 0.
template <int RT, int NB>  // NB blocks (2 NB vectors) of columns at `d`, held in registers for the chunk
inline void accumulate_quantized_span(float* acc, int64_t lda, const float* alpha, const float* p, int64_t ldp,
                                      const uint8_t* const* rows, int64_t format, int64_t n, int64_t d) {
  const int64_t bb = kv_block_bytes(format), off = d / KV_BLOCK * bb;
  __m512 a[RT][2 * NB];
  for (int r = 0; r < RT; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int j = 0; j < 2 * NB; ++j) a[r][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * lda + d + 16 * j), al);
  }
  for (int64_t c = 0; c < n; ++c) {
    __m512 vv[2 * NB];
    for (int b = 0; b < NB; ++b) kv_block_values(rows[c] + off + b * bb, format, vv[2 * b], vv[2 * b + 1]);
    for (int r = 0; r < RT; ++r) {
      const __m512 pc = _mm512_set1_ps(p[r * ldp + c]);
      for (int j = 0; j < 2 * NB; ++j) a[r][j] = _mm512_fmadd_ps(pc, vv[j], a[r][j]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < 2 * NB; ++j) _mm512_storeu_ps(acc + r * lda + d + 16 * j, a[r][j]);
}

template <int RT>
inline void accumulate_quantized_values(float* acc, int64_t lda, const float* alpha, const float* p, int64_t ldp,
                                        const uint8_t* const* rows, int64_t format, int64_t n, int64_t Dv) {
  int64_t d = 0;
  for (; d + 2 * KV_BLOCK <= Dv; d += 2 * KV_BLOCK)
    accumulate_quantized_span<RT, 2>(acc, lda, alpha, p, ldp, rows, format, n, d);
  if (d < Dv) accumulate_quantized_span<RT, 1>(acc, lda, alpha, p, ldp, rows, format, n, d);
}
#endif

// max(a, b), NaN if either is NaN (std::max and the max instructions drop a NaN in one of the two places).
inline float max_nan(float a, float b) { return (b > a || std::isnan(b)) ? b : a; }

// The largest of s[0:n], NaN if any of them is NaN (-inf for n == 0).
inline float max_of(const float* s, int64_t n) {
  int64_t c = 0;
  float mx = -std::numeric_limits<float>::infinity();
#if GQA_SIMD > 1
  if (n >= LANES) {
    vec vm = vset(mx);
    for (; c + LANES <= n; c += LANES) vm = vmax_nan(vm, vload(s + c));
    mx = vany_nan(vm) ? std::numeric_limits<float>::quiet_NaN() : vmaxof(vm);
  }
#endif
  for (; c < n; ++c) mx = max_nan(mx, s[c]);
  return mx;
}

// Logit soft-capping, s = cap * tanh(s / cap), in float32 to its own rounding for every cap. With u = s / cap:
//   |u| < 0.625: s + s * z P(z), z = u^2, P fitted to (tanh(u) / u - 1) / z (0.8 ulp), so that a large cap (u near 0)
//                keeps s's digits, where (e^2u - 1) / (e^2u + 1) lost them to cancellation (6e-2 off at a cap of 1e7);
//   beyond:      cap * sign(u) * (1 - e) / (1 + e), e = exp(-2|u|) <= 0.29 (no cancellation), +-cap once e is tiny.
// A NaN stays NaN; a cap beyond float32's range (inf here) leaves the scores as they are, which is cap * tanh(s / cap)
// to float32's rounding for every score below cap / 4096.
constexpr float TANH_POLY_BELOW = 0.625f;
constexpr float TANH_POLY[] = {-3.33332807e-1f, 1.33314475e-1f, -5.37401401e-2f, 2.06404906e-2f, -5.70657523e-3f};

// A soft-cap given as a double, in float32: a positive one stays positive (below float32's smallest: that smallest,
// which caps every score as the cap itself would), one beyond float32's range becomes inf. 0: none.
inline float softcap_float(double cap) {
  using limits = std::numeric_limits<float>;
  if (!(cap > 0.0)) return 0.0f;
  if (cap > limits::max()) return limits::infinity();  // (a cast from beyond the range would be undefined)
  return std::max(static_cast<float>(cap), limits::denorm_min());
}

// 1 / cap, at most float32's largest (a cap below ~3e-39: s * inf would make a score of 0 NaN).
inline float softcap_inverse(float cap) { return std::min(1.0f / cap, std::numeric_limits<float>::max()); }

inline float soft_cap_one(float s, float cap, float inv) {
  const float u = s * inv, z = u * u;
  if (!(std::fabs(u) < TANH_POLY_BELOW)) return cap * std::tanh(u);
  float p = TANH_POLY[4];
  for (int i = 3; i >= 0; --i) p = std::fma(p, z, TANH_POLY[i]);
  return std::fma(s, z * p, s);
}

#if GQA_SIMD > 1
inline vec soft_cap_lanes(vec s, vec cap, vec inv) {
  const vec u = vmul(s, inv), z = vmul(u, u), zero = vzero(), one = vset(1.0f);
  vec p = vset(TANH_POLY[4]);
  for (int i = 3; i >= 0; --i) p = vfma(p, z, vset(TANH_POLY[i]));
  const vec near_zero = vfma(s, vmul(z, p), s);
  const vec a = vmax(u, vsub(zero, u));  // |u| (NaN stays: the operand order)
  const vec e = vexp(vmul(vset(-2.0f), a));
  const vec t = vmul(cap, vdiv(vsub(one, e), vadd(one, e)));
  const vec beyond = vblend_negative(u, t, vsub(zero, t));
  return vblend_negative(vsub(a, vset(TANH_POLY_BELOW)), beyond, near_zero);  // |u| < 0.625: near_zero; NaN: beyond
}
#endif

// s[0:n] soft-capped (above). With SIMD every score takes the vector formula, the last partial vector padded, so a
// score's value does not depend on where in the chunk it sits.
inline void soft_cap(float* s, int64_t n, float cap) {
  const float inv = softcap_inverse(cap);
  int64_t c = 0;
#if GQA_SIMD > 1
  const vec vcap = vset(cap), vinv = vset(inv);
  for (; c + LANES <= n; c += LANES) vstore(s + c, soft_cap_lanes(vload(s + c), vcap, vinv));
  if (c < n) {
    float tail[LANES] = {};
    std::copy(s + c, s + n, tail);
    vstore(tail, soft_cap_lanes(vload(tail), vcap, vinv));
    std::copy(tail, tail + (n - c), s + c);
  }
#else
  for (; c < n; ++c) s[c] = soft_cap_one(s[c], cap, inv);
#endif
}

// p[0:n] = exp(s[0:n] - m), returns their sum.
inline float exp_shifted(float* s, float m, int64_t n) {
  int64_t c = 0;
  float sum = 0.0f;
#if GQA_SIMD > 1
  const vec vm = vset(m);
  vec vs = vzero();
  for (; c + LANES <= n; c += LANES) {
    const vec e = vexp(vsub(vload(s + c), vm));
    vstore(s + c, e);
    vs = vadd(vs, e);
  }
  sum = vsum(vs);
#endif
  for (; c < n; ++c) {
    s[c] = std::exp(s[c] - m);
    sum += s[c];
  }
  return sum;
}

struct MaskView {
  const void* data = nullptr;
  bool is_bool = false;
  int64_t sb = 0, sh = 0, sg = 0, sl = 0, ss = 0;  // strides of (B, H_kv, G, L, S), in elements
};


// One call's attention: q (B, H_kv, R, D), k (B, H_kv, S, D), v (B, H_kv, S, Dv) as pointers and strides (the last
// dim contiguous), cut into B * H_kv * splits tasks and combined row by row; partial results in `part_*`.
template <typename T>
struct GroupedAttention {
  const T *q, *k, *v;
  int64_t qs[3], ks[3], vs[3];  // strides of dims 0..2 of q, k, v
  int64_t B, H, R, D, S, Dv, L;
  float scale;
  bool causal;
  float softcap = 0.0f;           // > 0: scores become softcap * tanh(scores / softcap) before the mask
  const float* sinks = nullptr;   // (H_kv * G) logits, one per query head, in every row's softmax, or nullptr
  int64_t window = -1;            // >= 0 (one query row per sequence, L == 1): it sees only the window + 1 last keys
  MaskView mask;
  const int64_t* start;  // (B,) first visible slot per row (left padding), or nullptr
  // A paged cache: k and v are pools of blocks, dims 0..2 of ks/vs striding (block, head, slot in block); slot j of
  // row b is slot j % block of block table[b * table_stride + j / block]. Row b sees its first lengths[b] slots
  // (lengths may be set without a table too).
  const int64_t* table = nullptr;
  int64_t table_stride = 0, block = 0;
  const int64_t* lengths = nullptr;
  // A quantized cache (kv_blocks.h): k_blocks / v_blocks hold the rows of blocks (k and v unused), strides ks / vs in
  // bytes; format -1: that one is float, at k / v.
  const uint8_t *k_blocks = nullptr, *v_blocks = nullptr;
  int64_t k_format = -1, v_format = -1;
  int64_t splits, span;
  float *part_m, *part_l, *part_acc;  // (B * H_kv * splits, R), the same, (B * H_kv * splits, R, Dv)

  // Split the context so that there are a few tasks per thread, each at least 256 keys long. A paged cache is split
  // every PAGED_SPAN keys (rounded up to whole blocks) whatever the batch and the thread count: a row's result then
  // does not depend on the other rows of the batch.
  void plan(int64_t threads) {
    if (table != nullptr) {
      span = (PAGED_SPAN + block - 1) / block * block;
      splits = std::max<int64_t>(1, (S + span - 1) / span);
      return;
    }
    const int64_t heads = std::max<int64_t>(1, B * H);  // an empty batch has no tasks, and no division by zero
    splits = std::max<int64_t>(1, std::min<int64_t>((S + 255) / 256, (4 * threads + heads - 1) / heads));
    span = std::max<int64_t>(1, (S + splits - 1) / splits);  // at least 1: S may be 0
    splits = std::max<int64_t>(1, (S + span - 1) / span);
  }
  int64_t tasks() const { return B * H * splits; }
  int64_t part_floats() const { return tasks() * R * (2 + Dv); }  // what part_m, part_l and part_acc need together
  void set_parts(float* p) {
    part_m = p;
    part_l = p + tasks() * R;
    part_acc = p + 2 * tasks() * R;
  }

  // Per-thread buffers of `task`.
  struct Scratch {
    std::vector<float> qf, scores, alpha, ones, kbuf, vbuf, dq, dk;
    std::vector<int16_t> q16;
    std::vector<int32_t> qpairs, qoffs;  // the queries' int16 pairs in the key tiles' order (query_pairs_int16)
  };

  // Task `task` = (head, split): the partial result of head `task / splits` over its split of the keys.
  void task(int64_t task, Scratch& sc) const;

  // acc (R, Dv) = acc * alpha + p (R, CHUNK) [:, :n] @ v (n rows of Dv values, `sv` apart), ROW_TILE rows at a time.
  template <typename V>
  void accumulate_rows(float* acc, const float* alpha, const float* p, const V* v, int64_t sv, int64_t n) const {
    int64_t r = 0;
    for (; r + ROW_TILE <= R; r += ROW_TILE)
      accumulate_values<V, ROW_TILE>(acc + r * Dv, Dv, alpha + r, p + r * CHUNK, CHUNK, v, sv, n, Dv);
    // the last 1-3 rows together too (a KV head of 3 query heads, SmolLM2's, has only these)
    if (R - r == 3) accumulate_values<V, 3>(acc + r * Dv, Dv, alpha + r, p + r * CHUNK, CHUNK, v, sv, n, Dv);
    if (R - r == 2) accumulate_values<V, 2>(acc + r * Dv, Dv, alpha + r, p + r * CHUNK, CHUNK, v, sv, n, Dv);
    if (R - r == 1) accumulate_values<V, 1>(acc + r * Dv, Dv, alpha + r, p + r * CHUNK, CHUNK, v, sv, n, Dv);
  }

#if GQA_SIMD == 16
  // accumulate_rows over quantized value rows (rows[c]: key c's row of blocks).
  void accumulate_quantized_rows(float* acc, const float* alpha, const float* p, const uint8_t* const* rows,
                                 int64_t n) const {
    int64_t r = 0;
    for (; r + ROW_TILE <= R; r += ROW_TILE)
      accumulate_quantized_values<ROW_TILE>(acc + r * Dv, Dv, alpha + r, p + r * CHUNK, CHUNK, rows, v_format, n, Dv);
    if (R - r == 3) accumulate_quantized_values<3>(acc + r * Dv, Dv, alpha + r, p + r * CHUNK, CHUNK, rows, v_format, n, Dv);
    if (R - r == 2) accumulate_quantized_values<2>(acc + r * Dv, Dv, alpha + r, p + r * CHUNK, CHUNK, rows, v_format, n, Dv);
    if (R - r == 1) accumulate_quantized_values<1>(acc + r * Dv, Dv, alpha + r, p + r * CHUNK, CHUNK, rows, v_format, n, Dv);
  }
#endif

  // Row i of the (B * H_kv * R) output rows: the splits combined, out[0:Dv] = sum_s e^(m_s - M) acc_s / sum_s
  // e^(m_s - M) l_s (zeros for a row that sees no key). `row` is Dv floats of scratch.
  void combine(int64_t i, float* row, T* out) const;
};

template <typename T>
void GroupedAttention<T>::task(int64_t task, Scratch& sc) const {
  const float NEG_INF = -std::numeric_limits<float>::infinity();
#if defined(__AVX512BF16__)
  const bool use_dpbf16 = std::is_same_v<T, BFloat16> && D % 32 == 0 && k_format < 0;
#else
  const bool use_dpbf16 = false;
#endif
  sc.qf.resize(R * D);
  sc.scores.resize(R * CHUNK);
  sc.alpha.resize(R);
  if (static_cast<int64_t>(sc.ones.size()) < R) sc.ones.assign(R, 1.0f);
  const bool k_quantized = k_format >= 0, v_quantized = v_format >= 0;
  sc.kbuf.resize(std::is_same_v<T, float> && !k_quantized ? 0 : CHUNK * D);
  sc.vbuf.resize(v_quantized && GQA_SIMD != 16 ? CHUNK * Dv : 0);  // AVX-512 reads value blocks in registers
  float* qf = sc.qf.data();
  float* alpha = sc.alpha.data();
  const int64_t head = task / splits, split = task % splits, b = head / H, h = head % H;
  const int64_t S_b = lengths ? std::min(S, lengths[b]) : S;
  const int64_t j_begin = split * span, j_end = std::min(S_b, j_begin + span);
  const T* qh = q + b * qs[0] + h * qs[1];
  const int64_t* blocks = table ? table + b * table_stride : nullptr;
  // The key (value) row of slot j.
  auto row_of = [&](const T* base, const int64_t* st, int64_t j) -> const T* {
    if (blocks) return base + blocks[j / block] * st[0] + h * st[1] + (j % block) * st[2];
    return base + b * st[0] + h * st[1] + j * st[2];
  };
  auto key_row = [&](int64_t j) { return row_of(k, ks, j); };
  auto value_row = [&](int64_t j) { return row_of(v, vs, j); };
  // A quantized cache's rows of blocks, its strides in bytes.
  auto block_row = [&](const uint8_t* base, const int64_t* st, int64_t j) __attribute__((always_inline)) -> const uint8_t* {
    if (blocks) return base + blocks[j / block] * st[0] + h * st[1] + (j % block) * st[2];
    return base + b * st[0] + h * st[1] + j * st[2];
  };
  const int64_t k_bytes = k_quantized ? kv_row_bytes(k_format, D) : D * int64_t(sizeof(T));
  const int64_t v_bytes = v_quantized ? kv_row_bytes(v_format, Dv) : Dv * int64_t(sizeof(T));
  const int64_t sk = ks[2], sv = vs[2];
  const bool prefetch = prefetch_kv_rows();
  if (!use_dpbf16)  // vdpbf16ps reads the bf16 queries in place
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t d = 0; d < D; ++d) qf[r * D + d] = to_float(qh[r * qs[2] + d]) * scale;
      if (k_quantized) rotate_kv_row(qf + r * D, D);  // quantized keys are stored rotated (kv_blocks.h)
    }
  // quantized keys under bf16/fp16 queries: the queries as int16 blocks (INT_KEYS), unless one is not finite (then
  // the float path's NaN). float32 queries keep the float path: attention over the cache's values to float32's
  // rounding, as the tests hold it.
  bool int_keys = INT_KEYS && k_quantized && !std::is_same_v<T, float>;
  const int64_t nb = D / KV_BLOCK;
#if GQA_SIMD == 16 && defined(__AVX512VNNI__)
  if (int_keys) {
    for (int64_t i = 0; i < R * D; ++i) int_keys = int_keys && std::isfinite(qf[i]);
    if (int_keys) {
      sc.q16.resize(R * D);
      sc.dq.resize(R * nb);
      sc.dk.assign(nb * CHUNK, 0.0f);
      sc.qpairs.resize(R * D / 2);
      sc.qoffs.resize(R * nb);
      for (int64_t r = 0; r < R; ++r) {
        quantize_query_int16(qf + r * D, D, sc.q16.data() + r * D, sc.dq.data() + r * nb);
        query_pairs_int16(sc.q16.data() + r * D, D, k_format, sc.qpairs.data() + r * D / 2, sc.qoffs.data() + r * nb);
      }
    }
  }
#endif
  int32_t* kt = reinterpret_cast<int32_t*>(sc.kbuf.data());  // int_keys: the chunk's keys as key_tiles_int16's tiles
  float* m = part_m + task * R;
  float* l = part_l + task * R;
  float* acc = part_acc + task * R * Dv;
  std::fill(m, m + R, NEG_INF);
  std::fill(l, l + R, 0.0f);
  std::fill(acc, acc + R * Dv, 0.0f);
  int64_t first = start ? std::max(j_begin, start[b]) : j_begin;  // left padding: slots before start[b]
  if (window >= 0) first = std::max(first, S_b - 1 - window);     // a sliding window: the last window + 1 slots

  // A chunk of a paged cache spans several blocks: it is read in segments [a, a + seg_len(a)) within one block each
  // (the whole chunk without a table).
  auto seg_len = [&](int64_t a, int64_t end) { return blocks ? std::min(end - a, block - a % block) : end - a; };
  for (int64_t c0 = first, n; c0 < j_end; c0 += n) {
    n = std::min(CHUNK, j_end - c0);
#if GQA_SIMD > 1
    // Prefetch the K/V rows PREFETCH_CHUNKS chunks ahead where that helps (prefetch_kv_rows). Segment by segment (a
    // block's rows are evenly strided): no division per key.
    const int64_t p_end = prefetch ? std::min(j_end, c0 + (PREFETCH_CHUNKS + 1) * CHUNK) : c0;
    for (int64_t a = c0 + PREFETCH_CHUNKS * CHUNK, len; a < p_end; a += len) {
      len = seg_len(a, p_end);
      const char* kr = k_quantized ? reinterpret_cast<const char*>(block_row(k_blocks, ks, a))
                                   : reinterpret_cast<const char*>(key_row(a));
      const char* vr = v_quantized ? reinterpret_cast<const char*>(block_row(v_blocks, vs, a))
                                   : reinterpret_cast<const char*>(value_row(a));
      const int64_t k_step = k_quantized ? sk : sk * int64_t(sizeof(T)), v_step = v_quantized ? sv : sv * int64_t(sizeof(T));
      for (int64_t c = 0; c < len; ++c) {
        for (int64_t d = 0; d < k_bytes; d += 64) _mm_prefetch(kr + c * k_step + d, _MM_HINT_T0);
        for (int64_t d = 0; d < v_bytes; d += 64) _mm_prefetch(vr + c * v_step + d, _MM_HINT_T0);
      }
    }
#endif
    // bf16 and fp16 keys as float32 rows in kbuf (float32 keys are read in place, bf16 ones with vdpbf16ps), and
    // quantized ones dequantized there
    if (int_keys) {  // the chunk's keys as tiles, then every row's scores of the chunk
#if GQA_SIMD == 16 && defined(__AVX512VNNI__)
      const uint8_t* rows[CHUNK];
      for (int64_t c = 0; c < n; ++c) rows[c] = block_row(k_blocks, ks, c0 + c);
      key_tiles_int16(rows, k_format, nb, n, kt, sc.dk.data());
      for (int64_t r = 0; r < R; ++r)
        chunk_scores_int16(sc.qpairs.data() + r * D / 2, sc.qoffs.data() + r * nb, sc.dq.data() + r * nb, kt,
                           sc.dk.data(), nb, n, sc.scores.data() + r * CHUNK);
#endif
    } else if (k_quantized) {
      for (int64_t c = 0; c < n; ++c) dequantize_kv_row(block_row(k_blocks, ks, c0 + c), D, k_format, sc.kbuf.data() + c * D);
    } else if (!use_dpbf16 && !std::is_same_v<T, float>) {
      for (int64_t c = 0; c < n; ++c) to_float_row(key_row(c0 + c), sc.kbuf.data() + c * D, D);
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t g = r / L, lr = r % L;
      // Keys this row may see in the chunk: [c0, c0 + visible).
      int64_t visible = n;
      if (causal) visible = std::max<int64_t>(0, std::min(n, S - L + lr + 1 - c0));
      float* s = sc.scores.data() + r * CHUNK;
      if (int_keys) {
        // computed for the whole chunk above; the keys past `visible` are masked below
      } else if (k_quantized) {
        chunk_scores(qf + r * D, sc.kbuf.data(), D, visible, D, s);
      } else if constexpr (std::is_same_v<T, float>) {
        for (int64_t a = c0, len; a < c0 + visible; a += len)
          len = seg_len(a, c0 + visible), chunk_scores(qf + r * D, key_row(a), sk, len, D, s + (a - c0));
      } else if (!use_dpbf16) {
        chunk_scores(qf + r * D, sc.kbuf.data(), D, visible, D, s);
      }
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, BFloat16>) {
        if (use_dpbf16)
          for (int64_t a = c0, len; a < c0 + visible; a += len)
            len = seg_len(a, c0 + visible),
            chunk_scores_bf16(qh + r * qs[2], key_row(a), sk, len, D, scale, s + (a - c0));
      }
#endif
      if (softcap > 0.0f) soft_cap(s, visible, softcap);
      for (int64_t c = visible; c < n; ++c) s[c] = NEG_INF;
      if (mask.data) {
        const int64_t off = b * mask.sb + h * mask.sh + g * mask.sg + lr * mask.sl;
        if (mask.is_bool) {
          const bool* mp = static_cast<const bool*>(mask.data) + off;
          for (int64_t c = 0; c < visible; ++c)
            if (!mp[(c0 + c) * mask.ss]) s[c] = NEG_INF;
        } else {
          const float* mp = static_cast<const float*>(mask.data) + off;
          for (int64_t c = 0; c < visible; ++c) s[c] += mp[(c0 + c) * mask.ss];
        }
      }
      const float mx = max_of(s, visible);
      if (mx == NEG_INF) {  // nothing visible in this chunk for this row: weights 0, accumulator unchanged
        std::fill(s, s + n, 0.0f);
        alpha[r] = 1.0f;
        continue;
      }
      const float m_new = max_nan(m[r], mx);  // NaN stays: the row's output is NaN, as in torch
      alpha[r] = (m[r] == NEG_INF) ? 0.0f : std::exp(m[r] - m_new);
      const float psum = exp_shifted(s, m_new, visible);
      std::fill(s + visible, s + n, 0.0f);
      l[r] = l[r] * alpha[r] + psum;
      m[r] = m_new;
    }
    // the accumulators rescaled by alpha with the first segment's values (then by 1: exact)
    if (v_quantized) {
#if GQA_SIMD == 16  // the chunk's value rows read where they lie, dequantized in registers
      const uint8_t* rows[CHUNK];
      for (int64_t c = 0; c < n; ++c) rows[c] = block_row(v_blocks, vs, c0 + c);
      accumulate_quantized_rows(acc, alpha, sc.scores.data(), rows, n);
      continue;
#endif
      // the chunk's values dequantized into vbuf, then as float32 values
      for (int64_t c = 0; c < n; ++c) dequantize_kv_row(block_row(v_blocks, vs, c0 + c), Dv, v_format, sc.vbuf.data() + c * Dv);
      accumulate_rows(acc, alpha, sc.scores.data(), sc.vbuf.data(), Dv, n);
      continue;
    }
    for (int64_t a = c0, len; a < c0 + n; a += len) {
      len = seg_len(a, c0 + n);
      const T* vc = value_row(a);
      const float* scaled = a == c0 ? alpha : sc.ones.data();
      accumulate_rows(acc, scaled, sc.scores.data() + (a - c0), vc, sv, len);
    }
  }
}

template <typename T>
void GroupedAttention<T>::combine(int64_t i, float* row, T* out) const {
  const float NEG_INF = -std::numeric_limits<float>::infinity();
  const int64_t head = i / R, r = i % R;
  // A sink is one more key of the row's query head (h * G + r / L) whose value is zero: in the denominator only.
  const float sink = sinks ? sinks[(head % H) * (R / L) + r / L] : NEG_INF;
  float M = sink;
  for (int64_t s = 0; s < splits; ++s) M = max_nan(M, part_m[(head * splits + s) * R + r]);
  std::fill(row, row + Dv, 0.0f);
  float denom = sinks && M != NEG_INF ? std::exp(sink - M) : 0.0f;
  if (M != NEG_INF) {
    for (int64_t s = 0; s < splits; ++s) {
      const int64_t t = (head * splits + s) * R + r;
      if (part_m[t] == NEG_INF) continue;
      const float w = std::exp(part_m[t] - M);
      denom += w * part_l[t];
      const float* a = part_acc + t * Dv;
      for (int64_t d = 0; d < Dv; ++d) row[d] += w * a[d];
    }
  }
  const float inv = std::isnan(denom) ? denom : denom > 0.0f ? 1.0f / denom : 0.0f;
  for (int64_t d = 0; d < Dv; ++d) out[d] = static_cast<T>(row[d] * inv);
}

}  // namespace gqa_cpu
