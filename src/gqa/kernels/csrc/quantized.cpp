// gqa CPU kernels for GGUF block-quantized weights (built with cpu_kernels.cpp; see gqa/kernels/__init__.py).
//
// A weight matrix (M, K) is kept as it is in the GGUF file: M rows of K / 32 blocks, each block 32 weights:
//   q8_0 (34 bytes): fp16 d, 32 int8 q            w = d * q
//   q4_0 (18 bytes): fp16 d, 16 bytes of nibbles  w = d * (q - 8)
//   q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes      w = d * q + m
// (nibbles: byte j holds weight j in its low 4 bits and weight j + 16 in its high 4 bits).
//
//   gqa::qlinear_rows_n(x (N, K), blocks [(M_i, K / 32 * bytes)], formats [int], biases [(M_i,)?]) -> [(N, M_i)]
//       y = x @ dequant(W)^T + bias for a few rows N (decode), as llama.cpp computes it: each 32-value block of x is
//       quantized to int8 with its own scale (d_x = max|x| / 127), and a weight block's dot product with it is one
//       integer dot product (AVX512-VNNI vpdpbusd / AVX2 vpmaddubsw, unsigned 4/8-bit weights x signed 8-bit
//       activations) times d_w * d_x. Every thread streams its share of the weight rows once for all N rows.
//       An input block holding a NaN or an infinity cannot be quantized: it is left out of the integer products
//       (q = 0, d = 0) and its dot products with the weight blocks are taken in float, d * q (+ m) times x, and
//       added to the row's sum, so non-finite inputs give what x @ dequant(W)^T gives in float (NaN, +-inf) — the
//       rows without one take the integer path alone, unchanged.
//   gqa::dequantize_rows(blocks (M, K / 32 * bytes), format, K, dtype) -> (M, K) of dtype
//       the float weights (prefill, embedding rows), exactly d * q (+ m) rounded to dtype.
//
// x and y are float32 or bfloat16; formats: 0 = q8_0, 1 = q4_0, 2 = q4_1.

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

#include "quantized.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

using at::BFloat16;

constexpr int64_t QK = 32;  // weights per block
enum Format : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };

int64_t block_bytes(int64_t format) {
  switch (format) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    default: TORCH_CHECK(false, "gqa: unknown quantization format code ", format, " (0 q8_0, 1 q4_0, 2 q4_1)");
  }
  return 0;
}

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

using gqa::QuantizedRows;

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t N, int64_t K) {
  const int64_t nb = K / QK;
  QuantizedRows r{std::vector<int8_t>(N * K), std::vector<float>(N * nb), std::vector<float>(N * nb), {}};
  std::vector<float> xf(QK);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      const T* xb = x + n * K + b * QK;
      float amax = 0.0f;
      bool finite = true;
      for (int64_t i = 0; i < QK; ++i) {
        xf[i] = to_float(xb[i]);
        const float a = std::fabs(xf[i]);
        amax = std::max(amax, a);
        finite &= a <= std::numeric_limits<float>::max();  // false for +-inf and NaN (which std::max drops)
      }
      int8_t* qb = r.q.data() + n * K + b * QK;
      if (!finite) {  // taken in float by add_nonfinite_blocks; q, d, ds stay 0
        r.nonfinite.push_back(n * nb + b);
        continue;
      }
      const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
      if (!(id <= std::numeric_limits<float>::max())) {  // amax < ~3.7e-37: 1 / d overflows to inf, and x * id
        r.d[n * nb + b] = d;                                // (inf or NaN) has no int8: the block's q stay 0
        continue;
      }
      int32_t sum = 0;
      for (int64_t i = 0; i < QK; ++i) {
        qb[i] = static_cast<int8_t>(std::nearbyint(xf[i] * id));
        sum += qb[i];
      }
      r.d[n * nb + b] = d;
      r.ds[n * nb + b] = d * static_cast<float>(sum);
    }
  return r;
}

// Weight i of a block, d * q (+ m), as dequantize_rows gives it in float32.
inline float weight_at(const uint8_t* blk, int64_t format, float d, int64_t i) {
  if (format == Q8_0) return d * static_cast<float>(static_cast<int8_t>(blk[2 + i]));
  const float m = format == Q4_1 ? half_at(blk + 2) : -8.0f * d;
  const uint8_t byte = blk[(format == Q4_1 ? 4 : 2) + (i % 16)];
  return d * static_cast<float>(i < 16 ? (byte & 0x0F) : (byte >> 4)) + m;
}

// buf (N, rows) += the float dot products of the non-finite input blocks (xr.nonfinite) with weight rows w (rows of
// row_bytes bytes): sums of inf * w and NaN give what the float product gives (+-inf, NaN where inf * 0 or inf - inf).
template <typename T>
void add_nonfinite_blocks(const T* x, const QuantizedRows& xr, int64_t K, const uint8_t* w, int64_t format,
                          int64_t rows, int64_t row_bytes, float* buf) {
  const int64_t nb = K / QK, bytes = block_bytes(format);
  for (const int64_t nbi : xr.nonfinite) {
    const int64_t n = nbi / nb, b = nbi % nb;
    const T* xb = x + n * K + b * QK;
    for (int64_t i = 0; i < rows; ++i) {
      const uint8_t* blk = w + i * row_bytes + b * bytes;
      const float d = half_at(blk);
      float s = 0.0f;
      for (int64_t j = 0; j < QK; ++j) s += to_float(xb[j]) * weight_at(blk, format, d, j);
      buf[n * rows + i] += s;
    }
  }
}

#if defined(__AVX2__)
// Lane sums of u (unsigned bytes) * s (signed bytes), 8 int32 lanes: 4 products each.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));  // |u * s| <= 15 * 128: no saturation
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 weights of a 4-bit block as unsigned bytes in order 0..31.
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}
#endif

// out[n] = sum over blocks of w_row . x_n for one weight row and NR rows of quantized x (at xq, stride K).
template <int F, int NR>
inline void qdot_row(const uint8_t* w, int64_t nb, const QuantizedRows& xr, int64_t n0, int64_t K, float* out) {
  constexpr int64_t BYTES = F == Q8_0 ? 34 : F == Q4_0 ? 18 : 20;
  const int64_t nbx = K / QK;
#if defined(__AVX2__)
  // U blocks per iteration, each into its own accumulator: one FMA chain per accumulator would wait on the FMA
  // latency every block (measured: ~5 cycles per block with one chain).
  constexpr int U = 4;
  __m256 acc[NR][U];
  float mins[NR][U] = {};
  for (int n = 0; n < NR; ++n)
    for (int u = 0; u < U; ++u) acc[n][u] = _mm256_setzero_ps();
  int64_t b = 0;
  auto block = [&](int64_t bi, int u) {
    const uint8_t* blk = w + bi * BYTES;
    const float dw = half_at(blk);
    __m256i wq;
    if constexpr (F == Q8_0) {
      wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    } else {
      wq = nibbles(blk + (F == Q4_1 ? 4 : 2));
    }
    // q8_0: signed weights; |w| as unsigned bytes times sign(w) * x keeps the u8 x s8 form (llama.cpp's trick).
    const __m256i wu = F == Q8_0 ? _mm256_sign_epi8(wq, wq) : wq;
    for (int n = 0; n < NR; ++n) {
      const int64_t xi = (n0 + n) * nbx + bi;
      __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.q.data() + (n0 + n) * K + bi * QK));
      if constexpr (F == Q8_0) xq = _mm256_sign_epi8(xq, wq);
      acc[n][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(wu, xq)), _mm256_set1_ps(dw * xr.d[xi]), acc[n][u]);
      if constexpr (F == Q4_0) mins[n][u] -= 8.0f * dw * xr.ds[xi];
      if constexpr (F == Q4_1) mins[n][u] += half_at(blk + 2) * xr.ds[xi];
    }
  };
  for (; b + U <= nb; b += U) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (b + 8) * BYTES), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (b + 8) * BYTES + 64), _MM_HINT_T0);
    for (int u = 0; u < U; ++u) block(b + u, u);
  }
  for (; b < nb; ++b) block(b, 0);
  for (int n = 0; n < NR; ++n) {
    __m256 a = _mm256_add_ps(_mm256_add_ps(acc[n][0], acc[n][1]), _mm256_add_ps(acc[n][2], acc[n][3]));
    out[n] = hsum(a) + (mins[n][0] + mins[n][1]) + (mins[n][2] + mins[n][3]);
  }
#else
  float scalar[NR] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BYTES;
    const float dw = half_at(blk);
    for (int n = 0; n < NR; ++n) {
      const int64_t xi = (n0 + n) * nbx + b;
      const int8_t* xq = xr.q.data() + (n0 + n) * K + b * QK;
      int32_t dot = 0;
      for (int64_t i = 0; i < QK; ++i) {
        int32_t q;
        if constexpr (F == Q8_0) {
          q = static_cast<int8_t>(blk[2 + i]);
        } else {
          const uint8_t byte = blk[(F == Q4_1 ? 4 : 2) + (i % 16)];
          q = i < 16 ? (byte & 0x0F) : (byte >> 4);
        }
        dot += q * xq[i];
      }
      scalar[n] += dw * xr.d[xi] * static_cast<float>(dot);
      if constexpr (F == Q4_0) scalar[n] -= 8.0f * dw * xr.ds[xi];
      if constexpr (F == Q4_1) scalar[n] += half_at(blk + 2) * xr.ds[xi];
    }
  }
  for (int n = 0; n < NR; ++n) out[n] = scalar[n];
#endif
}

template <int F>
void qdot_rows(const uint8_t* w, int64_t rows, int64_t row_bytes, const QuantizedRows& xr, int64_t N, int64_t K,
               float* buf) {  // buf (N, rows)
  const int64_t nb = K / QK;
  float out[4];
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* wr = w + i * row_bytes;
    for (int64_t n0 = 0; n0 < N; n0 += 4) {
      const int64_t nr = std::min<int64_t>(4, N - n0);
      switch (nr) {
        case 1: qdot_row<F, 1>(wr, nb, xr, n0, K, out); break;
        case 2: qdot_row<F, 2>(wr, nb, xr, n0, K, out); break;
        case 3: qdot_row<F, 3>(wr, nb, xr, n0, K, out); break;
        default: qdot_row<F, 4>(wr, nb, xr, n0, K, out); break;
      }
      for (int64_t n = 0; n < nr; ++n) buf[(n0 + n) * rows + i] = out[n];
    }
  }
}

// buf (N, rows) = x @ dequant(w)^T for `rows` weight rows of `format` at w; xr is x quantized by quantize_rows.
template <typename T>
void rows_dot(const uint8_t* w, int64_t format, int64_t rows, int64_t K, const QuantizedRows& xr, const T* x,
              int64_t N, float* buf) {
  const int64_t row_bytes = K / QK * block_bytes(format);
  switch (format) {
    case Q8_0: qdot_rows<Q8_0>(w, rows, row_bytes, xr, N, K, buf); break;
    case Q4_0: qdot_rows<Q4_0>(w, rows, row_bytes, xr, N, K, buf); break;
    default: qdot_rows<Q4_1>(w, rows, row_bytes, xr, N, K, buf); break;
  }
  if (!xr.nonfinite.empty()) add_nonfinite_blocks(x, xr, K, w, format, rows, row_bytes, buf);
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
      const int64_t rows = m1 - m0, row_bytes = K / QK * block_bytes(part.format);
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
  TORCH_CHECK(K % QK == 0, "gqa::qlinear_rows: K = ", K, " is not a multiple of the block size 32");
  std::vector<at::Tensor> outs;
  std::vector<QPart> parts;
  int64_t first_tile = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const at::Tensor& w = blocks[i];
    const int64_t row_bytes = K / QK * block_bytes(formats[i]);
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
  const int64_t nb = K / QK, bytes = block_bytes(format);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + (r * nb + b) * bytes;
        T* o = out + r * K + b * QK;
        const float d = half_at(blk);
        if (format == Q8_0) {
          for (int64_t i = 0; i < QK; ++i) o[i] = static_cast<T>(d * static_cast<float>(static_cast<int8_t>(blk[2 + i])));
        } else {
          const float m = format == Q4_1 ? half_at(blk + 2) : -8.0f * d;
          const uint8_t* qs = blk + (format == Q4_1 ? 4 : 2);
          for (int64_t i = 0; i < 16; ++i) {
            o[i] = static_cast<T>(d * static_cast<float>(qs[i] & 0x0F) + m);
            o[i + 16] = static_cast<T>(d * static_cast<float>(qs[i] >> 4) + m);
          }
        }
      }
  });
}

at::Tensor dequantize_rows(const at::Tensor& blocks, int64_t format, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK(K > 0 && K % QK == 0, "gqa::dequantize_rows: K = ", K, " is not a positive multiple of 32");
  const int64_t row_bytes = K / QK * block_bytes(format);
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

int64_t gqa::quantized_row_bytes(int64_t format, int64_t K) { return K / QK * block_bytes(format); }

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

TORCH_LIBRARY_FRAGMENT(gqa, m) {
  m.def("qlinear_rows_n(Tensor x, Tensor[] blocks, int[] formats, Tensor?[] biases) -> Tensor[]");
  m.def("dequantize_rows(Tensor blocks, int format, int K, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(gqa, CPU, m) {
  m.impl("qlinear_rows_n", &qlinear_rows_n);
  m.impl("dequantize_rows", &dequantize_rows);
}
