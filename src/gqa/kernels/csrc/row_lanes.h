// Few-row quantized products with the input rows in SIMD lanes (AVX-512 VNNI builds): the prompt rows,
// serving's batch rows and speculation's draft rows. A weight block is unpacked once into 32 unsigned bytes and each
// group of four is broadcast against the same four inputs of 8 or 16 rows at once (vpdpbusd), so a block's exact
// integer dot products with every row of the group come out in lanes, with no horizontal sums; the scales and the
// four float chains are lane-wise too. Each lane does what quantized.cpp's dot1 does for its row — the same integer
// sums, the same float operations in the same order — so a row's result does not depend on its batch. A group of <= 8
// rows of the nibble formats takes two weight rows at a time in the full width (lanes_pair_dot).
//
// q8_0's signed weights go in as w + 128 (unsigned): the products then hold 128 * (the sum of the block's q_x) more,
// taken off exactly with the integer sums quantize_rows keeps; q6_k's q - 32 likewise as q, per 16-value half. The K
// formats' sub-blocks (k_quants.h) follow kdot1 as the 32-value formats follow dot1.
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "blocks.h"
#include "k_quants.h"
#include "quantized.h"

#if defined(GQA_ZMM_DOTS)  // blocks.h: AVX-512 VNNI (with VL, BW, DQ)
#define GQA_ROW_LANES 1

namespace gqa_blocks {

inline int32_t four_bytes(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The lane widths: 16 rows in a zmm, 8 in a ymm (a group of <= 8 rows runs at half the width, or twice in a zmm).
template <int L>
struct Lanes;

template <>
struct Lanes<16> {
  using I = __m512i;
  using V = __m512;
  static I izero() { return _mm512_setzero_si512(); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I iload(const int32_t* p) { return _mm512_loadu_si512(p); }
  static I imul(I a, int32_t b) { return _mm512_mullo_epi32(a, _mm512_set1_epi32(b)); }
  template <int BITS>
  static I shl(I a) { return _mm512_slli_epi32(a, BITS); }
  // the J-th four bytes of w in every lane
  template <int J>
  static I spread(__m256i w) {
    return _mm512_permutexvar_epi32(_mm512_set1_epi32(J), _mm512_castsi256_si512(w));
  }
  // two weight rows' (w: the first's 32 bytes in the low half, the second's in the high): the J-th four bytes of the
  // first in lanes 0-7, of the second in lanes 8-15
  template <int J>
  static I spread(__m512i w) {
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(J, J, J, J, J, J, J, J, 8 + J, 8 + J, 8 + J, 8 + J, 8 + J,
                                                      8 + J, 8 + J, 8 + J), w);
  }
  // the J-th four bytes of every 128-bit lane of v (Quads)
  template <int J>
  static I spread_in(I v) {
    return _mm512_shuffle_epi32(v, static_cast<_MM_PERM_ENUM>(J * 0x55));
  }
  // the 16 bytes at p in every 128-bit lane
  static I lanes_of(const uint8_t* p) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // those at p in 128-bit lanes 0-1 and those at q in 128-bit lanes 2-3 (two weight rows' blocks, lanes_pair_dot)
  static I lanes_of(const uint8_t* p, const uint8_t* q) {
    return _mm512_mask_broadcast_i32x4(lanes_of(p), 0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  }
  static I and8(I a, int8_t m) { return _mm512_and_si512(a, _mm512_set1_epi8(m)); }
  static I xor8(I a, int8_t m) { return _mm512_xor_si512(a, _mm512_set1_epi8(m)); }
  static I shr4(I a) { return _mm512_srli_epi16(a, 4); }
  static I dot(I acc, I w, const int8_t* x) { return _mm512_dpbusd_epi32(acc, w, _mm512_loadu_si512(x)); }
  // two weight rows' blocks' first four bytes as two halves each (d, then m or two bytes the format does not use) in
  // floats: those at p in float lanes 0-7, those at q in 8-15, d in the even lanes, the next half in the odd;
  // pick<0> takes d to every lane of its half, pick<1> the next half (m)
  static V halves(const uint8_t* p, const uint8_t* q) {
    const __m256i both = _mm256_blend_epi32(_mm256_set1_epi32(four_bytes(p)), _mm256_set1_epi32(four_bytes(q)), 0xF0);
    return _mm512_cvtph_ps(both);
  }
  template <int J>
  static V pick(V h) {
    return _mm512_shuffle_ps(h, h, J * 0x55);
  }
  static V zero() { return _mm512_setzero_ps(); }
  static V cvt(I s) { return _mm512_cvtepi32_ps(s); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};

template <>
struct Lanes<8> {
  using I = __m256i;
  using V = __m256;
  static I izero() { return _mm256_setzero_si256(); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I iload(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I imul(I a, int32_t b) { return _mm256_mullo_epi32(a, _mm256_set1_epi32(b)); }
  template <int BITS>
  static I shl(I a) { return _mm256_slli_epi32(a, BITS); }
  template <int J>
  static I spread(__m256i w) {
    return _mm256_permutevar8x32_epi32(w, _mm256_set1_epi32(J));
  }
  template <int J>
  static I spread_in(I v) {
    return _mm256_shuffle_epi32(v, J * 0x55);
  }
  static I lanes_of(const uint8_t* p) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I and8(I a, int8_t m) { return _mm256_and_si256(a, _mm256_set1_epi8(m)); }
  static I xor8(I a, int8_t m) { return _mm256_xor_si256(a, _mm256_set1_epi8(m)); }
  static I shr4(I a) { return _mm256_srli_epi16(a, 4); }
  static I dot(I acc, I w, const int8_t* x) {
    return _mm256_dpbusd_epi32(acc, w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  }
  static V zero() { return _mm256_setzero_ps(); }
  static V cvt(I s) { return _mm256_cvtepi32_ps(s); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};

// A weight block's 32 values as unsigned bytes, in order (q8_0: q + 128).
template <int F>
__attribute__((always_inline)) inline __m256i lane_weights(const uint8_t* blk) {
  if constexpr (F == Q8_0) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)), _mm256_set1_epi8(-128));
  } else if constexpr (five_bit(F)) {
    return _mm256_or_si256(nibbles(blk + nibbles_at(F)), fifth_bits(blk + high_bits_at(F)));
  } else {
    return nibbles(blk + nibbles_at(F));
  }
}

// A weight block's 32 unsigned values as lane_weights has them, laid out for in-lane shuffles: values 0-15 in every
// 128-bit lane of lo, 16-31 in every one of hi (two weight rows' blocks: the first's in lanes 0-1, the second's in
// 2-3), read by broadcasting loads, so that each group of four reaches every lane by a shuffle within 128-bit lanes
// (vpshufd) rather than a permute across them (vpermd): 16 rows of a 1536 x 576 Q4_1 matrix 1.1x the speed in a
// one-thread loop (in L2), 1.14x with two integer chains instead of four. For the formats whose values are their
// bytes, or their nibbles, in order.
template <int F>
constexpr bool quad_lanes = F == Q8_0 || F == Q4_0 || F == Q4_1;

template <class S>
struct Quads {
  typename S::I lo, hi;
};

template <int F, class S, class... B>
__attribute__((always_inline)) inline Quads<S> lane_quads(B... blk) {
  if constexpr (F == Q8_0) {
    return {S::xor8(S::lanes_of((blk + 2)...), -128), S::xor8(S::lanes_of((blk + 2 + QK / 2)...), -128)};
  } else {
    const typename S::I v = S::lanes_of((blk + nibbles_at(F))...);
    return {S::and8(v, 0x0F), S::and8(S::shr4(v), 0x0F)};
  }
}

// The J-th four weights (J < 8) of w (lane_weights' vector, a pair's, or Quads) in every lane.
template <int L, int J, class W>
__attribute__((always_inline)) inline typename Lanes<L>::I spread(const W& w) {
  if constexpr (std::is_same_v<W, Quads<Lanes<L>>>) {
    return Lanes<L>::template spread_in<J % 4>(J < 4 ? w.lo : w.hi);
  } else {
    return Lanes<L>::template spread<J>(w);
  }
}

// The four float chains (and their minima's) of every lane, and their sum stored per row:
// out[n * stride] = ((acc_0 + acc_2) + (acc_1 + acc_3)) + ((min_0 + min_2) + (min_1 + min_3)), lane n, n < rows.
template <class S>
struct Chains {
  typename S::V acc[4] = {S::zero(), S::zero(), S::zero(), S::zero()};
  typename S::V mins[4] = {S::zero(), S::zero(), S::zero(), S::zero()};

  typename S::V sum() const {
    const typename S::V a = S::add(S::add(acc[0], acc[2]), S::add(acc[1], acc[3]));
    const typename S::V m = S::add(S::add(mins[0], mins[2]), S::add(mins[1], mins[3]));
    return S::add(a, m);
  }
  void store(int64_t rows, float* out, int64_t stride) const {
    alignas(64) float o[sizeof(typename S::V) / sizeof(float)];
    S::store(o, sum());
    for (int64_t n = 0; n < rows; ++n) out[n * stride] = o[n];
  }
  // two weight rows' sums (lanes_pair_dot): lane n to out[n * stride], lane 8 + n to out[n * stride + 1], n < rows
  void store_pair(int64_t rows, float* out, int64_t stride) const {
    static_assert(sizeof(typename S::V) == 16 * sizeof(float), "two weight rows take the 16 lanes");
    alignas(64) float o[16];
    S::store(o, sum());
    for (int64_t n = 0; n < rows; ++n) out[n * stride] = o[n], out[n * stride + 1] = o[8 + n];
  }
};

// Lane group g's inputs in xr: the interleaved int8 values, then per block its rows' d, ds and the integer sums of
// their q (all 32, the first 16).
struct LaneInputs {
  const int8_t* q;
  const float *d, *ds;
  const int32_t *sum, *sum_lo;
  LaneInputs(const gqa::QuantizedRows& xr, const gqa::QuantizedRows::LaneGroup& g)
      : q(xr.lq.data() + g.q_at),
        d(xr.ld.data() + g.s_at),
        ds(xr.lds.data() + g.s_at),
        sum(xr.lsum.data() + g.s_at),
        sum_lo(xr.lsum_lo.data() + g.s_at) {}
};

// The products of a block's 32 unsigned weights w with the lanes' inputs at xb, in two independent chains of vpdpbusd,
// exact integer sums: p[0] the first 16 weights', p[1] the last 16's. W: Quads, each group of four reaching the lanes
// by an in-lane shuffle (spread_in), or one weight row's 32 bytes (__m256i) or two rows' (__m512i: Lanes<16>'s pair
// spread), each group by one permute (measured when every format took it: q8_0 at 8 lanes 1.23x the speed of
// broadcasting them from a copy on the stack, q4_k 1.11x, q6_k 1.21x; 16 lanes the same).
//
// Always inlined, as lane_block and lane_weights: a call (GCC inlined none of them in every use, and called
// lane_products through the PLT) clobbers every zmm, so the caller's chains went to the stack around each block
// (a 16-row verification pass 1.3x slower).
template <int L, class W>
__attribute__((always_inline)) inline void lane_products(const W& w, const int8_t* xb, typename Lanes<L>::I p[2]) {
  using S = Lanes<L>;
  p[0] = S::dot(S::izero(), spread<L, 0>(w), xb);
  p[1] = S::dot(S::izero(), spread<L, 4>(w), xb + 16 * L);
  p[0] = S::dot(p[0], spread<L, 1>(w), xb + 4 * L);
  p[1] = S::dot(p[1], spread<L, 5>(w), xb + 20 * L);
  p[0] = S::dot(p[0], spread<L, 2>(w), xb + 8 * L);
  p[1] = S::dot(p[1], spread<L, 6>(w), xb + 24 * L);
  p[0] = S::dot(p[0], spread<L, 3>(w), xb + 12 * L);
  p[1] = S::dot(p[1], spread<L, 7>(w), xb + 28 * L);
}

// A block's integer sums s (every lane's) into chain C: scaled by dw (the weight block's d per lane) and the rows' d,
// plus mw (the weight block's min per lane) times the rows' ds (q8_0: s less 128 * the rows' sums of q, no min).
template <int F, int L, int C>
__attribute__((always_inline)) inline void add_block(typename Lanes<L>::I s, typename Lanes<L>::V dw,
                                                    typename Lanes<L>::V mw, int64_t b, const LaneInputs& x,
                                                    Chains<Lanes<L>>& c) {
  using S = Lanes<L>;
  if constexpr (F == Q8_0) s = S::isub(s, S::template shl<7>(S::iload(x.sum + b * L)));
  c.acc[C] = S::fma(S::cvt(s), S::mul(dw, S::load(x.d + b * L)), c.acc[C]);
  if constexpr (F != Q8_0) c.mins[C] = S::fma(mw, S::load(x.ds + b * L), c.mins[C]);
}

// The integer sums of lane_products' two chains.
template <int L>
__attribute__((always_inline)) inline typename Lanes<L>::I chain_sum(const typename Lanes<L>::I p[2]) {
  return Lanes<L>::iadd(p[0], p[1]);
}

// block_min in every lane from a block's halves (Lanes::halves: d, then m where the format has one).
template <int F, class S>
__attribute__((always_inline)) inline typename S::V lane_min(typename S::V h) {
  if constexpr (F == Q8_0) {
    return S::zero();
  } else if constexpr (has_min(F)) {
    return S::template pick<1>(h);
  } else {
    return S::mul(S::set1(-q_offset(F)), S::template pick<0>(h));
  }
}

// Block b (at blk) of one weight row against lane group x, into chain C of every lane.
template <int F, int L, int C>
__attribute__((always_inline)) inline void lane_block(const uint8_t* blk, int64_t b, const LaneInputs& x,
                                                     Chains<Lanes<L>>& c) {
  using S = Lanes<L>;
  typename S::I p[2];
  if constexpr (quad_lanes<F>) {
    lane_products<L>(lane_quads<F, S>(blk), x.q + b * QK * L, p);
  } else {
    lane_products<L>(lane_weights<F>(blk), x.q + b * QK * L, p);
  }
  const float dw = half_at(blk);
  add_block<F, L, C>(chain_sum<L>(p), S::set1(dw), F == Q8_0 ? S::zero() : S::set1(block_min<F>(blk, dw)), b, x, c);
}

// Block b of two weight rows (at blk and blk + next) against the 16 lanes of an 8-lane group's rows twice: the first
// row's products in lanes 0-7, the second's in 8-15, each lane doing what lane_block<F, 8> does for it.
template <int F, int C>
__attribute__((always_inline)) inline void lane_pair_block(const uint8_t* blk, int64_t next, int64_t b,
                                                          const LaneInputs& x, Chains<Lanes<16>>& c) {
  using S = Lanes<16>;
  const uint8_t* blk2 = blk + next;
  typename S::I p[2];
  if constexpr (quad_lanes<F>) {
    lane_products<16>(lane_quads<F, S>(blk, blk2), x.q + b * QK * 16, p);
  } else {
    lane_products<16>(_mm512_inserti64x4(_mm512_castsi256_si512(lane_weights<F>(blk)), lane_weights<F>(blk2), 1),
                      x.q + b * QK * 16, p);
  }
  const S::V h = S::halves(blk, blk2);
  add_block<F, 16, C>(chain_sum<16>(p), S::pick<0>(h), lane_min<F, S>(h), b, x, c);
}

// block(at, b, chain) for the nb blocks of a weight row at w (BYTES each), four at a time, chain = b % 4 a constant
// (the chains stay in registers: 1.2x the speed of indexing them by b & 3); the four blocks ahead of each at are
// prefetched from `next` bytes on too when another weight row's blocks are read with these (lanes_pair_dot).
template <int64_t BYTES, int64_t NEXT, class Block>
__attribute__((always_inline)) inline void each_block(const uint8_t* w, int64_t nb, int64_t next, Block&& block) {
  using C0 = std::integral_constant<int, 0>;
  using C1 = std::integral_constant<int, 1>;
  using C2 = std::integral_constant<int, 2>;
  using C3 = std::integral_constant<int, 3>;
  auto prefetch = [&](const uint8_t* blk) {
    prefetch_ahead(blk, 4 * BYTES);
    if constexpr (NEXT != 0) prefetch_ahead(blk + next, 4 * BYTES);
  };
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    const uint8_t* blk = w + b * BYTES;
    prefetch(blk);
    block(blk, b, C0{}), block(blk + BYTES, b + 1, C1{}), block(blk + 2 * BYTES, b + 2, C2{});
    block(blk + 3 * BYTES, b + 3, C3{});
  }
  if (b < nb) prefetch(w + b * BYTES);
  if (b < nb) block(w + b * BYTES, b, C0{}), ++b;  // the last 1-3 blocks
  if (b < nb) block(w + b * BYTES, b, C1{}), ++b;
  if (b < nb) block(w + b * BYTES, b, C2{});
}

// out[n * stride] for the g.rows rows of lane group g and one weight row w of nb blocks.
template <int F, int L>
inline void lanes_dot(const uint8_t* w, int64_t nb, const gqa::QuantizedRows& xr,
                      const gqa::QuantizedRows::LaneGroup& g, float* out, int64_t stride) {
  const LaneInputs x(xr, g);
  Chains<Lanes<L>> c;
  each_block<block_bytes_of(F), 0>(w, nb, 0, [&](const uint8_t* blk, int64_t b, auto chain) {
    lane_block<F, L, decltype(chain)::value>(blk, b, x, c);
  });
  c.store(g.rows, out, stride);
}

// lanes_dot<F, 8> for two weight rows at once, w and w + next, into out[n * stride] and out[n * stride + 1]: g holds
// an 8-lane group's rows twice in 16 lanes (QuantizedRows::twice). Bit for bit lanes_dot's sums, in half the
// instructions: 8 rows of Q4_1 1.32-1.39x the speed when both spread by permutes (one thread, the weights in L2 or
// streamed from DRAM). Not for q8_0 (pair_lanes): from DRAM its two rows' streams ran at 0.76-0.96x one row's (1.34x
// in L2).
template <int F>
constexpr bool pair_lanes = !k_quant(F) && F != Q8_0;

template <int F>
inline void lanes_pair_dot(const uint8_t* w, int64_t next, int64_t nb, const gqa::QuantizedRows& xr,
                           const gqa::QuantizedRows::LaneGroup& g, float* out, int64_t stride) {
  const LaneInputs x(xr, g);
  Chains<Lanes<16>> c;
  each_block<block_bytes_of(F), 1>(w, nb, next, [&](const uint8_t* blk, int64_t b, auto chain) {
    lane_pair_block<F, decltype(chain)::value>(blk, next, b, x, c);
  });
  c.store_pair(g.rows, out, stride);
}

// The K formats' sub-blocks in lanes (k_quants.h's kdot1 for each row): per super-block its scales once, then each
// sub-block's 32 q (q6_k: q + 32, unsigned) broadcast four at a time. q6_k's two scales per sub-block multiply the
// integer sums of its halves, each less 32 * the half's sum of q_x: the same integer kdot1 sums.
template <int F, int L>
inline void lanes_kdot(const uint8_t* w, int64_t nb, const gqa::QuantizedRows& xr,
                       const gqa::QuantizedRows::LaneGroup& g, float* out, int64_t stride) {
  using S = Lanes<L>;
  constexpr int64_t BYTES = block_bytes_of(F);
  const LaneInputs x(xr, g);
  Chains<S> c;
  for (int64_t s = 0; s < nb / 8; ++s) {
    const uint8_t* sb = w + s * BYTES;
    prefetch_ahead(sb, BYTES);
    const SuperScales sc = super_scales<F>(sb);
    for (int j0 = 0; j0 < 8; j0 += 4) {
      __m256i wq[4], scales[4];
      k_quad<F>(sb, j0, wq, scales);
      for (int i = 0; i < 4; ++i) {
        const __m256i q = F == Q6_K ? _mm256_add_epi8(wq[i], _mm256_set1_epi8(32)) : wq[i];
        const int j = j0 + i;
        const int64_t b = s * 8 + j;
        typename S::I p[2];  // the first half's sums, the second's
        lane_products<L>(q, x.q + b * QK * L, p);
        typename S::I sum;
        if constexpr (F == Q6_K) {
          const typename S::I lo_x = S::iload(x.sum_lo + b * L), hi_x = S::isub(S::iload(x.sum + b * L), lo_x);
          const typename S::I lo = S::isub(p[0], S::template shl<5>(lo_x));
          const typename S::I hi = S::isub(p[1], S::template shl<5>(hi_x));
          sum = S::iadd(S::imul(lo, static_cast<int8_t>(sb[192 + 2 * j])),
                        S::imul(hi, static_cast<int8_t>(sb[193 + 2 * j])));
        } else {
          sum = S::iadd(p[0], p[1]);
        }
        c.acc[i] = S::fma(S::cvt(sum), S::mul(S::set1(sc.dw[j]), S::load(x.d + b * L)), c.acc[i]);
        if constexpr (F != Q6_K) c.mins[i] = S::fma(S::set1(sc.mw[j]), S::load(x.ds + b * L), c.mins[i]);
      }
    }
  }
  c.store(g.rows, out, stride);
}

// Packs rows [0, N) of a quantized input (q (N, K), d, ds, and the integer sums of each block's q, isum (N, K / 32),
// and of its first 16, isum_lo) into xr's lane groups, and the last group's rows twice in 16 lanes when it is an
// 8-lane group (1-8 rows).
inline void pack_lanes(gqa::QuantizedRows& xr, const int32_t* isum, const int32_t* isum_lo, int64_t N, int64_t K) {
  const int64_t nb = K / QK;
  int64_t q_at = 0, s_at = 0;
  for (int64_t n0 = 0; n0 < N;) {
    const int64_t lanes = N - n0 > 8 ? 16 : 8, rows = std::min<int64_t>(lanes, N - n0);
    xr.groups.push_back({n0, rows, lanes, q_at, s_at});
    q_at += lanes * K, s_at += lanes * nb, n0 += rows;
  }
  gqa::QuantizedRows::LaneGroup& last = xr.groups.back();
  if (last.lanes == 8) {
    s_at = (s_at + 15) / 16 * 16;  // its scales start a cache line (an odd nb leaves 8 floats over)
    last.twice = static_cast<int64_t>(xr.twice.size());
    xr.twice.push_back({last.n0, last.rows, 16, q_at, s_at});
    q_at += 16 * K, s_at += 16 * nb;
  }
  xr.lq.assign(q_at, 0);
  xr.ld.assign(s_at, 0.0f), xr.lds.assign(s_at, 0.0f), xr.lsum.assign(s_at, 0), xr.lsum_lo.assign(s_at, 0);
  for (const auto& g : xr.groups)
    for (int64_t r = 0; r < g.rows; ++r) {
      const int64_t n = g.n0 + r;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t s = g.s_at + b * g.lanes + r;
        xr.ld[s] = xr.d[n * nb + b], xr.lds[s] = xr.ds[n * nb + b], xr.lsum[s] = isum[n * nb + b];
        xr.lsum_lo[s] = isum_lo[n * nb + b];
        int8_t* dst = xr.lq.data() + g.q_at + b * QK * g.lanes + 4 * r;
        const int8_t* src = xr.q.data() + n * K + b * QK;
        for (int j = 0; j < 8; ++j) std::memcpy(dst + j * 4 * g.lanes, src + 4 * j, 4);
      }
    }
  if (last.twice < 0) return;
  const auto& t = xr.twice[last.twice];  // the 8-lane group's lanes copied into t's lanes 0-7 and 8-15
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t from = last.s_at + b * 8, to = t.s_at + b * 16 + 8 * h;
      std::copy_n(xr.ld.data() + from, 8, xr.ld.data() + to), std::copy_n(xr.lds.data() + from, 8, xr.lds.data() + to);
      std::copy_n(xr.lsum.data() + from, 8, xr.lsum.data() + to);
      std::copy_n(xr.lsum_lo.data() + from, 8, xr.lsum_lo.data() + to);
      const int8_t* src = xr.lq.data() + last.q_at + b * QK * 8;
      int8_t* dst = xr.lq.data() + t.q_at + b * QK * 16 + 32 * h;
      for (int j = 0; j < 8; ++j) std::memcpy(dst + j * 64, src + j * 32, 32);
    }
}

}  // namespace gqa_blocks

#endif
