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

#include "quantized.h"
#include "simd.h"

namespace {

using namespace gqa_simd;

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
                           float scale, int64_t L, bool causal, at::Tensor& out, const int64_t* start = nullptr) {
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
      const int64_t first = start ? std::max(j_begin, start[b]) : j_begin;  // left padding: slots before start[b]

      for (int64_t c0 = first; c0 < j_end; c0 += CHUNK) {
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

// ---------------------------------------------------------------------------------------------------------------
// The rest of one decoded token's layer, each op one call instead of the handful of ATen ops (and their dispatch)
// it replaces; rounding to x's dtype happens where the eager PyTorch code rounds, so results match it.

// y = w * T(x / rms(x)), the rms in float32 (HF's RMSNorm). x (N, E), w (E,), both of one dtype.
template <typename T>
void rms_norm_impl(const T* x, const T* w, T* y, int64_t N, int64_t E, float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const T* xn = x + n * E;
    float ss = 0.0f;
    for (int64_t e = 0; e < E; ++e) ss += to_float(xn[e]) * to_float(xn[e]);
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(E) + eps);
    for (int64_t e = 0; e < E; ++e)
      y[n * E + e] = static_cast<T>(to_float(w[e]) * to_float(static_cast<T>(to_float(xn[e]) * r)));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "gqa::rms_norm: x must be contiguous (N, E) and weight (E,) of its dtype, got ", x.sizes(), " and ",
              weight.sizes());
  at::Tensor y = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float>(x.const_data_ptr<float>(), weight.const_data_ptr<float>(), y.mutable_data_ptr<float>(),
                         x.size(0), x.size(1), static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gqa::rms_norm: float32 or bfloat16 only, got ", x.scalar_type());
    rms_norm_impl<BFloat16>(x.const_data_ptr<BFloat16>(), weight.const_data_ptr<BFloat16>(),
                            y.mutable_data_ptr<BFloat16>(), x.size(0), x.size(1), static_cast<float>(eps));
  }
  return y;
}

// y = T(silu(gate)) * up (SwiGLU), gate and up (N, F) of one dtype.
template <typename T>
void silu_mul_impl(const T* g, const T* u, T* y, int64_t n) {
  int64_t i = 0;
#if GQA_SIMD > 1
  // silu(x) = x * sigmoid(x), with e = exp(-|x|) (vexp takes arguments <= 0): sigmoid = 1 / (1 + e) for x >= 0,
  // e / (1 + e) for x < 0. The result is rounded to T before the product with up, as torch rounds silu's output.
  float tmp[LANES];
  for (; i + LANES <= n; i += LANES) {
    const vec x = vload(g + i);
    const vec e = vexp(vmul(vset(-1.0f), vmax(x, vsub(vzero(), x))));
    const vec r = vdiv(vset(1.0f), vadd(vset(1.0f), e));
    vstore(tmp, vmul(x, vblend_negative(x, r, vmul(e, r))));
    for (int j = 0; j < LANES; ++j)
      y[i + j] = static_cast<T>(to_float(static_cast<T>(tmp[j])) * to_float(u[i + j]));
  }
#endif
  for (; i < n; ++i) {
    const float x = to_float(g[i]);
    y[i] = static_cast<T>(to_float(static_cast<T>(x / (1.0f + std::exp(-x)))) * to_float(u[i]));
  }
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.is_contiguous() && up.is_contiguous() &&
                  gate.scalar_type() == up.scalar_type(),
              "gqa::silu_mul: gate and up must be contiguous, of one shape and dtype, got ", gate.sizes(), " and ",
              up.sizes());
  at::Tensor y = at::empty_like(gate);
  if (gate.scalar_type() == at::kFloat) {
    silu_mul_impl<float>(gate.const_data_ptr<float>(), up.const_data_ptr<float>(), y.mutable_data_ptr<float>(),
                         gate.numel());
  } else {
    TORCH_CHECK(gate.scalar_type() == at::kBFloat16, "gqa::silu_mul: float32 or bfloat16 only");
    silu_mul_impl<BFloat16>(gate.const_data_ptr<BFloat16>(), up.const_data_ptr<BFloat16>(),
                            y.mutable_data_ptr<BFloat16>(), gate.numel());
  }
  return y;
}

// Rotate one head vector (HF half-rotation RoPE over all D features) in float32: out = x cos + rotate_half(x) sin.
template <typename T>
inline void rope_row(const T* x, const float* cos, const float* sin, T* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rot = d < half ? -to_float(x[d + half]) : to_float(x[d - half]);
    out[d] = static_cast<T>(to_float(x[d]) * cos[d] + rot * sin[d]);
  }
}

template <typename T>
void decode_attend_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& start,
                        int64_t pos, float scale, at::Tensor& qr, at::Tensor& out) {
  const int64_t B = key_cache.size(0), H = key_cache.size(1), D = key_cache.size(3), Dv = value_cache.size(3);
  const int64_t Hq = q.size(1) / D;
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  T* kc = key_cache.mutable_data_ptr<T>();
  T* vc = value_cache.mutable_data_ptr<T>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h)
      rope_row(q.const_data_ptr<T>() + b * Hq * D + h * D, cp + b * D, sp + b * D,
               qr.mutable_data_ptr<T>() + (b * Hq + h) * D, D);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t slot = b * key_cache.stride(0) + h * key_cache.stride(1) + pos * key_cache.stride(2);
      rope_row(k.const_data_ptr<T>() + (b * H + h) * D, cp + b * D, sp + b * D, kc + slot, D);
      const T* vs = v.const_data_ptr<T>() + (b * H + h) * Dv;
      std::copy(vs, vs + Dv, vc + b * value_cache.stride(0) + h * value_cache.stride(1) + pos * value_cache.stride(2));
    }
  }
  const at::Tensor keys = key_cache.narrow(2, 0, pos + 1), values = value_cache.narrow(2, 0, pos + 1);
  const at::Tensor qv = qr.view({B, H, Hq / H, D});
  decode_attention_impl<T>(qv, keys, values, MaskView{}, scale, 1, false, out, start.const_data_ptr<int64_t>());
}

// One decoded token's attention: RoPE on q and k, k and v written into slot `cursor` of the caches, the G query
// heads of each KV head attending to slots [start[b], cursor] of row b; cursor += 1.
// q (B, H_q * D), k (B, H_kv * D), v (B, H_kv * Dv), cos/sin (B, D) float32, caches (B, H_kv, C, D|Dv),
// start (B,) int64, cursor () int64 -> (B, H_q * Dv).
at::Tensor decode_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& start,
                         at::Tensor cursor, double scale) {
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "gqa::decode_attend: caches must be (B, H_kv, C, D) with contiguous rows");
  const int64_t B = key_cache.size(0), H = key_cache.size(1), C = key_cache.size(2), D = key_cache.size(3);
  const int64_t Dv = value_cache.size(3);
  TORCH_CHECK(D % 2 == 0, "gqa::decode_attend: head_dim must be even for RoPE, got ", D);
  TORCH_CHECK(q.dim() == 2 && q.size(0) == B && q.size(1) % (D * H) == 0 && q.is_contiguous(),
              "gqa::decode_attend: q must be contiguous (B, H_q * D) with H_kv | H_q, got ", q.sizes());
  TORCH_CHECK(k.dim() == 2 && k.sizes() == at::IntArrayRef({B, H * D}) && k.is_contiguous() && v.dim() == 2 &&
                  v.sizes() == at::IntArrayRef({B, H * Dv}) && v.is_contiguous(),
              "gqa::decode_attend: k must be (B, H_kv * D) and v (B, H_kv * Dv), contiguous; got ", k.sizes(), ", ",
              v.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == key_cache.scalar_type() && q.scalar_type() == value_cache.scalar_type(),
              "gqa::decode_attend: q, k, v and the caches must share a dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == at::IntArrayRef({B, D}) && sin.sizes() == cos.sizes(),
              "gqa::decode_attend: cos and sin must be contiguous float32 (B, D), got ", cos.sizes());
  TORCH_CHECK(start.scalar_type() == at::kLong && start.is_contiguous() && start.sizes() == at::IntArrayRef({B}) &&
                  cursor.scalar_type() == at::kLong && cursor.dim() == 0,
              "gqa::decode_attend: start must be int64 (B,) and cursor an int64 scalar");
  const int64_t pos = cursor.item<int64_t>();
  TORCH_CHECK(pos >= 0 && pos < C, "gqa::decode_attend: the cache is full (", C, " slots)");
  at::Tensor qr = at::empty_like(q);
  at::Tensor out = at::empty({B, H, q.size(1) / (D * H), Dv}, q.options());
  if (q.scalar_type() == at::kFloat) {
    decode_attend_impl<float>(q, k, v, cos, sin, key_cache, value_cache, start, pos, static_cast<float>(scale), qr,
                              out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "gqa::decode_attend: float32 or bfloat16 only");
    decode_attend_impl<BFloat16>(q, k, v, cos, sin, key_cache, value_cache, start, pos, static_cast<float>(scale), qr,
                                 out);
  }
  cursor.add_(1);
  return out.view({B, -1});
}

// x (N, K) times a group of weight matrices of one input (q/k/v, gate/up): float weights (format -1) through
// linear_rows_n, block-quantized ones (format >= 0) through gqa::quantized_linear_rows; a mixed group one by one.
std::vector<at::Tensor> project(const at::Tensor& x, at::TensorList weights, at::IntArrayRef formats,
                                const c10::List<c10::optional<at::Tensor>>& biases) {
  const bool all_float = std::all_of(formats.begin(), formats.end(), [](int64_t f) { return f < 0; });
  const bool all_quantized = std::all_of(formats.begin(), formats.end(), [](int64_t f) { return f >= 0; });
  if (all_float) return linear_rows_n(x, weights, biases);
  if (all_quantized) return gqa::quantized_linear_rows(x, weights, formats, biases);
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < weights.size(); ++i) {
    c10::List<c10::optional<at::Tensor>> bias;
    bias.push_back(biases.get(i));
    outs.push_back(project(x, {weights[i]}, {formats[i]}, bias)[0]);
  }
  return outs;
}

// One decoder layer for one new token per row, in one call (Llama/Qwen2: pre-norm attention and SwiGLU MLP, no
// output biases):  x += o_proj(attend(rope(q, k), v));  x += down(silu(gate(h)) * up(h)), h = rms_norm(x).
// weights: [q, k, v, o, gate, up, down] (float (M, K) or blocks), formats: 7 codes (-1 float), qkv_biases: 3 (or
// None); the rest as in decode_attend. x (B, E) -> (B, E).
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& norm1, const at::Tensor& norm2, double eps,
                        at::TensorList weights, at::IntArrayRef formats,
                        const c10::List<c10::optional<at::Tensor>>& qkv_biases, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& start,
                        at::Tensor cursor, double scale) {
  TORCH_CHECK(weights.size() == 7 && formats.size() == 7 && qkv_biases.size() == 3,
              "gqa::decode_layer: 7 weights and formats (q, k, v, o, gate, up, down) and 3 q/k/v biases");
  c10::List<c10::optional<at::Tensor>> none1, none2;
  none1.push_back(c10::nullopt);
  none2.push_back(c10::nullopt);
  none2.push_back(c10::nullopt);
  const at::Tensor h = rms_norm(x, norm1, eps);
  const auto qkv = project(h, weights.slice(0, 3), formats.slice(0, 3), qkv_biases);
  const at::Tensor a = decode_attend(qkv[0], qkv[1], qkv[2], cos, sin, key_cache, value_cache, start, cursor, scale);
  const at::Tensor x1 = x + project(a, weights.slice(3, 1), formats.slice(3, 1), none1)[0];
  const at::Tensor h1 = rms_norm(x1, norm2, eps);
  const auto gate_up = project(h1, weights.slice(4, 2), formats.slice(4, 2), none2);
  const at::Tensor m = silu_mul(gate_up[0], gate_up[1]);
  return x1 + project(m, weights.slice(6, 1), formats.slice(6, 1), none1)[0];
}

// A whole decode step for one new token per row, in one call: every layer as decode_layer, then the final norm and
// lm_head. Per layer l: norms1[l], norms2[l], weights[7l .. 7l+7), formats likewise, qkv_biases[3l .. 3l+3),
// key_caches[l], value_caches[l], starts[l], cursors[l]; eps and scale shared. head: float (V, E) or blocks, its
// format in head_format (-1 float). x (B, E) -> logits (B, V).
at::Tensor decode_model(const at::Tensor& x, at::TensorList norms1, at::TensorList norms2, double eps,
                        at::TensorList weights, at::IntArrayRef formats,
                        const c10::List<c10::optional<at::Tensor>>& qkv_biases, const at::Tensor& cos,
                        const at::Tensor& sin, at::TensorList key_caches, at::TensorList value_caches,
                        at::TensorList starts, at::TensorList cursors, double scale, const at::Tensor& final_norm,
                        double final_eps, const at::Tensor& head, int64_t head_format) {
  const size_t L = norms1.size();
  TORCH_CHECK(norms2.size() == L && weights.size() == 7 * L && formats.size() == 7 * L &&
                  qkv_biases.size() == 3 * L && key_caches.size() == L && value_caches.size() == L &&
                  starts.size() == L && cursors.size() == L,
              "gqa::decode_model: per layer 2 norms, 7 weights and formats, 3 q/k/v biases, K and V caches, a start "
              "and a cursor; got ", L, " layers' norms1 and ", weights.size(), " weights");
  at::Tensor h = x;
  for (size_t l = 0; l < L; ++l) {
    c10::List<c10::optional<at::Tensor>> biases;
    for (size_t i = 0; i < 3; ++i) biases.push_back(qkv_biases.get(3 * l + i));
    h = decode_layer(h, norms1[l], norms2[l], eps, weights.slice(7 * l, 7), formats.slice(7 * l, 7), biases, cos,
                     sin, key_caches[l], value_caches[l], starts[l], cursors[l], scale);
  }
  c10::List<c10::optional<at::Tensor>> none;
  none.push_back(c10::nullopt);
  return project(rms_norm(h, final_norm, final_eps), {head}, {head_format}, none)[0];
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
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def(
      "decode_attend(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor start, Tensor(c!) cursor, float scale) -> Tensor");
  m.def(
      "decode_layer(Tensor x, Tensor norm1, Tensor norm2, float eps, Tensor[] weights, int[] formats, "
      "Tensor?[] qkv_biases, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor start, "
      "Tensor(c!) cursor, float scale) -> Tensor");
  m.def(
      "decode_model(Tensor x, Tensor[] norms1, Tensor[] norms2, float eps, Tensor[] weights, int[] formats, "
      "Tensor?[] qkv_biases, Tensor cos, Tensor sin, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, "
      "Tensor[] starts, Tensor(c!)[] cursors, float scale, Tensor final_norm, float final_eps, Tensor head, "
      "int head_format) -> Tensor");
}

TORCH_LIBRARY_IMPL(gqa, CPU, m) {
  m.impl("linear_rows", &linear_rows);
  m.impl("linear_rows_n", &linear_rows_n);
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("decode_attend", &decode_attend);
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_model", &decode_model);
}
