// gqa CPU kernels, built once on the machine that runs them (see gqa/kernels/__init__.py).
//
//   gqa::linear_rows(x (N, K), weight (M, K), bias (M,)?) -> (N, M)
//       y = x @ weight^T + bias for a few rows N (decode): every thread streams its own slice of weight rows once,
//       all N rows of x at a time. nn.Linear's (out, in) layout is the streaming order, so no re-layout is needed.
//   gqa::linear_rows_n(x (N, K), weights [(M_i, K)], biases [(M_i,)?]) -> [(N, M_i)]
//       the same for several matrices of one input (q/k/v, gate/up) in one parallel region.
//
//   gqa::decode_attention(q (B, H_kv, R, D), k (B, H_kv, S, D), v (B, H_kv, S, Dv),
//                         mask (B, H_kv, G, L, S)?, scale, query_len L, causal) -> (B, H_kv, R, Dv)
//       The R = G * L query rows of one KV head (the whole group, all new tokens) attend to that head's keys in one
//       pass: each key and value row is read once for all R rows; softmax is online (running max and sum, float32),
//       the context is split into chunks so that both threads stream even for one head. k/v may be strided views of a
//       larger cache (only the last dim must be contiguous). The mask is any strided (often expanded, stride 0) view;
//       bool = allowed, float = added to the scores. causal: row r = g * L + l sees keys j <= S - L + l.
//       A row that sees no key returns zeros.
//
//   gqa::simd_width() -> int: float32 lanes the build vectorizes with (16 AVX-512, 8 AVX2 + FMA, 1 none).
//
// float32 and bfloat16 (all tensors one dtype; accumulation and softmax in float32). SIMD where the compiler targets
// it (-march=native): AVX-512 (16 lanes; vdpbf16ps for bf16 with AVX512-BF16) or AVX2 with FMA (8 lanes); plain loops
// otherwise. gqa::simd_width() says which was built.

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

namespace {

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
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }  // a > b ? a : b: NaN in either gives b
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
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }  // a > b ? a : b: NaN in either gives b
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

// ---------------------------------------------------------------------------------------------------------------
// linear_rows

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

// One weight matrix of a (possibly multi-matrix) call: y (N, M) = x (N, K) @ w (M, K)^T + bias.
struct LinearPart {
  const void* w;
  const void* bias;
  void* y;
  int64_t M;
  int64_t first_tile;  // index of its first 4-row tile among all parts' tiles
};

template <typename T>
void linear_rows_impl(const at::Tensor& x, const std::vector<LinearPart>& parts) {
  const int64_t N = x.size(0), K = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  const int64_t tiles = parts.back().first_tile + (parts.back().M + 3) / 4;
  // One parallel region over the 4-row tiles of every matrix (q/k/v or gate/up share one thread wake-up); at least
  // 16 tiles per chunk so that small layers do not pay for waking threads they cannot use.
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf;
    for (const LinearPart& part : parts) {
      const int64_t p0 = std::max(t0, part.first_tile), p1 = std::min(t1, part.first_tile + (part.M + 3) / 4);
      if (p0 >= p1) continue;
      const int64_t M = part.M, m0 = (p0 - part.first_tile) * 4, m1 = std::min(M, (p1 - part.first_tile) * 4);
      const int64_t rows = m1 - m0;
      const T* wp = static_cast<const T*>(part.w) + m0 * K;
      const T* bp = static_cast<const T*>(part.bias);
      T* yp = static_cast<T*>(part.y);
      buf.resize(4 * rows);
      for (int64_t n0 = 0; n0 < N; n0 += 4) {
        const int64_t nr = std::min<int64_t>(4, N - n0);
        const T* xn = xp + n0 * K;
        switch (nr) {
          case 1: gemv_rows_nr<T, 1>(wp, K, xn, buf.data(), rows, rows); break;
          case 2: gemv_rows_nr<T, 2>(wp, K, xn, buf.data(), rows, rows); break;
          case 3: gemv_rows_nr<T, 3>(wp, K, xn, buf.data(), rows, rows); break;
          default: gemv_rows_nr<T, 4>(wp, K, xn, buf.data(), rows, rows); break;
        }
        for (int64_t n = 0; n < nr; ++n)
          for (int64_t i = 0; i < rows; ++i) {
            float v = buf[n * rows + i];
            if (bp) v += to_float(bp[m0 + i]);
            yp[(n0 + n) * M + m0 + i] = static_cast<T>(v);
          }
      }
    }
  });
}

std::vector<at::Tensor> linear_rows_n(const at::Tensor& x, at::TensorList weights,
                                      const c10::List<c10::optional<at::Tensor>>& biases) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "gqa::linear_rows: x must be a contiguous (N, K) matrix, got ",
              x.sizes());
  TORCH_CHECK(!weights.empty() && biases.size() == weights.size(),
              "gqa::linear_rows: one bias (or None) per weight, and at least one weight");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "gqa::linear_rows: float32 or bfloat16 only, got ", x.scalar_type());
  std::vector<at::Tensor> outs;
  std::vector<LinearPart> parts;
  int64_t first_tile = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "gqa::linear_rows: x ", x.sizes(), " and weight ", w.sizes(),
                " disagree on K");
    TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous(),
                "gqa::linear_rows: weights must be contiguous and of x's dtype");
    const c10::optional<at::Tensor> b = biases.get(i);
    if (b.has_value()) {
      TORCH_CHECK(b->dim() == 1 && b->size(0) == w.size(0) && b->is_contiguous() && b->scalar_type() == w.scalar_type(),
                  "gqa::linear_rows: bias must be contiguous (M,) of the weight's dtype, got ", b->sizes());
    }
    outs.push_back(at::empty({x.size(0), w.size(0)}, x.options()));
    if (w.size(0) == 0) continue;
    parts.push_back({w.const_data_ptr(), b.has_value() ? b->const_data_ptr() : nullptr, outs.back().mutable_data_ptr(),
                     w.size(0), first_tile});
    first_tile += (w.size(0) + 3) / 4;
  }
  if (parts.empty() || x.size(0) == 0) return outs;
  if (x.scalar_type() == at::kFloat) {
    linear_rows_impl<float>(x, parts);
  } else {
    linear_rows_impl<BFloat16>(x, parts);
  }
  return outs;
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  c10::List<c10::optional<at::Tensor>> biases;
  biases.push_back(bias);
  return linear_rows_n(x, {weight}, biases)[0];
}

// ---------------------------------------------------------------------------------------------------------------
// decode_attention

constexpr int64_t CHUNK = 64;  // keys per online-softmax step: the chunk's K/V rows stay in L1
constexpr int64_t ROW_TILE = 4;         // query rows that share each loaded value row
constexpr int64_t PREFETCH_CHUNKS = 2;  // K/V rows this many chunks ahead are prefetched

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
  for (; c < n; c += 16) {
    const int64_t m = std::min<int64_t>(16, n - c);
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

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const MaskView& mask,
                           float scale, int64_t L, bool causal, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), S = k.size(2), Dv = v.size(3);
  const int64_t G = R / L;
  const int64_t threads = at::get_num_threads();
  const int64_t heads = B * H;
  // Split the context so that there are a few tasks per thread, each at least 256 keys long.
  int64_t splits = std::max<int64_t>(1, std::min<int64_t>((S + 255) / 256, (4 * threads + heads - 1) / heads));
  const int64_t span = (S + splits - 1) / splits;
  splits = std::max<int64_t>(1, (S + span - 1) / span);

  // Partial results per (head, split): R running maxima, R sums, R x Dv accumulators.
  std::vector<float> part_m(heads * splits * R), part_l(heads * splits * R), part_acc(heads * splits * R * Dv);
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  const float NEG_INF = -std::numeric_limits<float>::infinity();

#if defined(__AVX512BF16__)
  const bool use_dpbf16 = std::is_same_v<T, BFloat16> && D % 32 == 0;
#else
  const bool use_dpbf16 = false;
#endif

  at::parallel_for(0, heads * splits, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(R * D), scores(R * CHUNK), alpha(R), kbuf(std::is_same_v<T, float> ? 0 : CHUNK * D);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t head = task / splits, split = task % splits, b = head / H, h = head % H;
      const int64_t j_begin = split * span, j_end = std::min(S, j_begin + span);
      const T* qh = qp + b * q.stride(0) + h * q.stride(1);
      const T* kh = kp + b * k.stride(0) + h * k.stride(1);
      const T* vh = vp + b * v.stride(0) + h * v.stride(1);
      const int64_t sk = k.stride(2), sv = v.stride(2);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = to_float(qh[r * q.stride(2) + d]) * scale;
      float* m = part_m.data() + task * R;
      float* l = part_l.data() + task * R;
      float* acc = part_acc.data() + task * R * Dv;
      std::fill(m, m + R, NEG_INF);
      std::fill(l, l + R, 0.0f);
      std::fill(acc, acc + R * Dv, 0.0f);

      for (int64_t c0 = j_begin; c0 < j_end; c0 += CHUNK) {
        const int64_t n = std::min(CHUNK, j_end - c0);
#if GQA_SIMD > 1
        // Prefetch the K/V rows PREFETCH_CHUNKS chunks ahead: the hardware prefetcher alone leaves bandwidth unused.
        for (int64_t c = c0 + PREFETCH_CHUNKS * CHUNK; c < std::min(j_end, c0 + (PREFETCH_CHUNKS + 1) * CHUNK); ++c) {
          for (int64_t d = 0; d < D; d += 64 / int64_t(sizeof(T)))
            _mm_prefetch(reinterpret_cast<const char*>(kh + c * sk + d), _MM_HINT_T0);
          for (int64_t d = 0; d < Dv; d += 64 / int64_t(sizeof(T)))
            _mm_prefetch(reinterpret_cast<const char*>(vh + c * sv + d), _MM_HINT_T0);
        }
#endif
        const float* kc = nullptr;  // the chunk's keys as float32 rows, stride kstride
        int64_t kstride = 0;
        if (use_dpbf16) {
          // scores straight from the bf16 rows, below
        } else if constexpr (std::is_same_v<T, float>) {
          kc = kh + c0 * sk;
          kstride = sk;
        } else {
          for (int64_t c = 0; c < n; ++c) to_float_row(kh + (c0 + c) * sk, kbuf.data() + c * D, D);
          kc = kbuf.data();
          kstride = D;
        }
        for (int64_t r = 0; r < R; ++r) {
          const int64_t g = r / L, lr = r % L;
          // Keys this row may see in the chunk: [c0, c0 + visible).
          int64_t visible = n;
          if (causal) visible = std::max<int64_t>(0, std::min(n, S - L + lr + 1 - c0));
          float* s = scores.data() + r * CHUNK;
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, BFloat16>) {
            if (use_dpbf16) chunk_scores_bf16(qh + r * q.stride(2), kh + c0 * sk, sk, visible, D, scale, s);
          }
#endif
          if (!use_dpbf16) chunk_scores(qf.data() + r * D, kc, kstride, visible, D, s);
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
        const T* vc = vh + c0 * sv;
        int64_t r = 0;
        for (; r + ROW_TILE <= R; r += ROW_TILE)
          accumulate_values<T, ROW_TILE>(acc + r * Dv, Dv, alpha.data() + r, scores.data() + r * CHUNK, CHUNK, vc,
                                         sv, n, Dv);
        for (; r < R; ++r)
          accumulate_values<T, 1>(acc + r * Dv, Dv, alpha.data() + r, scores.data() + r * CHUNK, CHUNK, vc, sv, n,
                                  Dv);
      }
    }
  });

  // Combine the splits of each head: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
  T* op = out.mutable_data_ptr<T>();
  at::parallel_for(0, heads * R, 64, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(Dv);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t head = i / R, r = i % R;
      float M = NEG_INF;
      for (int64_t s = 0; s < splits; ++s) M = max_nan(M, part_m[(head * splits + s) * R + r]);
      std::fill(row.begin(), row.end(), 0.0f);
      float denom = 0.0f;
      if (M != NEG_INF) {
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t t = (head * splits + s) * R + r;
          if (part_m[t] == NEG_INF) continue;
          const float w = std::exp(part_m[t] - M);
          denom += w * part_l[t];
          const float* a = part_acc.data() + t * Dv;
          for (int64_t d = 0; d < Dv; ++d) row[d] += w * a[d];
        }
      }
      const float inv = std::isnan(denom) ? denom : denom > 0.0f ? 1.0f / denom : 0.0f;
      T* o = op + i * Dv;
      for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<T>(row[d] * inv);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale, int64_t query_len, bool causal) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "gqa::decode_attention: q (B, H_kv, R, D), k (B, H_kv, S, D), v (B, H_kv, S, Dv) must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "gqa::decode_attention: q, k, v must share a dtype");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "gqa::decode_attention: the last dim of q, k, v must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && v.size(0) == B && v.size(1) == H && v.size(2) == S &&
                  k.size(3) == q.size(3),
              "gqa::decode_attention: shapes disagree: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(query_len >= 1 && R % query_len == 0, "gqa::decode_attention: query_len ", query_len,
              " must divide the ", R, " rows");
  MaskView mv;
  if (mask.has_value()) {
    const at::Tensor& mk = *mask;
    TORCH_CHECK(mk.dim() == 5 && mk.size(0) == B && mk.size(1) == H && mk.size(2) == R / query_len &&
                    mk.size(3) == query_len && mk.size(4) == S,
                "gqa::decode_attention: mask must be (B, H_kv, G, L, S), got ", mk.sizes());
    TORCH_CHECK(mk.scalar_type() == at::kBool || mk.scalar_type() == at::kFloat,
                "gqa::decode_attention: mask must be bool or float32");
    mv.data = mk.const_data_ptr();
    mv.is_bool = mk.scalar_type() == at::kBool;
    mv.sb = mk.stride(0), mv.sh = mk.stride(1), mv.sg = mk.stride(2), mv.sl = mk.stride(3), mv.ss = mk.stride(4);
  }
  at::Tensor out = at::empty({B, H, R, v.size(3)}, q.options());
  if (S == 0 || B * H * R == 0) return out.zero_();
  if (q.scalar_type() == at::kFloat) {
    decode_attention_impl<float>(q, k, v, mv, static_cast<float>(scale), query_len, causal, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_attention_impl<BFloat16>(q, k, v, mv, static_cast<float>(scale), query_len, causal, out);
  } else {
    TORCH_CHECK(false, "gqa::decode_attention: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

int64_t simd_width() { return GQA_SIMD; }

}  // namespace

TORCH_LIBRARY(gqa, m) {
  m.def("simd_width() -> int", &simd_width);  // no tensor arguments: one kernel for every backend
  m.def("linear_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_rows_n(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor[]");
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, int query_len, bool causal) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(gqa, CPU, m) {
  m.impl("linear_rows", &linear_rows);
  m.impl("linear_rows_n", &linear_rows_n);
  m.impl("decode_attention", &decode_attention);
}
