// The small ops of a decoded token's layer (RMSNorm, SwiGLU's silu(gate) * up, RoPE), rounding to the activations'
// dtype where the eager PyTorch code rounds, so results match it.
#pragma once
#include "simd.h"

namespace gqa_cpu {

using namespace gqa_simd;

// 1 / rms(x) of one row of E values, in float32: 1 / sqrt(mean(x^2) + eps). The squares are summed LANES at a time,
// then the lanes, then the rest one by one: a fixed order for a row whatever its batch (one scalar chain of E adds
// was half of a 16-row step's norms: 61 norms a step, each 576 adds 4 cycles apart).
template <typename T>
inline float inv_rms(const T* x, int64_t E, float eps) {
  float ss = 0.0f;
  int64_t e = 0;
#if GQA_SIMD > 1
  if (E >= LANES) {
    vec acc = vzero();
    for (; e + LANES <= E; e += LANES) {
      const vec v = vload(x + e);
      acc = vfma(v, v, acc);
    }
    ss = vsum(acc);
  }
#endif
  for (; e < E; ++e) ss += to_float(x[e]) * to_float(x[e]);
  return 1.0f / std::sqrt(ss / static_cast<float>(E) + eps);
}

// y = w * T(x / rms(x)), the rms in float32 (HF's RMSNorm). x (N, E), w (E,), both of one dtype.
template <typename T>
void rms_norm_impl(const T* x, const T* w, T* y, int64_t N, int64_t E, float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const T* xn = x + n * E;
    const float r = inv_rms(xn, E, eps);
    for (int64_t e = 0; e < E; ++e)
      y[n * E + e] = static_cast<T>(to_float(w[e]) * to_float(static_cast<T>(to_float(xn[e]) * r)));
  }
}

#if GQA_SIMD > 1
// y[0:n] from gate g and up u, LANES elements per `lanes(g, u, y)` call; a last partial vector is padded, so every
// element takes the same formula wherever it sits (a row alone equals the same row in a batch, bit for bit).
template <typename T, typename Lanes>
inline void gated_by_lanes(const Lanes& lanes, const T* g, const T* u, T* y, int64_t n) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) lanes(g + i, u + i, y + i);
  if (i < n) {  // the lanes are independent
    T gp[LANES] = {}, up[LANES] = {}, yp[LANES];
    std::copy(g + i, g + n, gp);
    std::copy(u + i, u + n, up);
    lanes(gp, up, yp);
    std::copy(yp, yp + (n - i), y + i);
  }
}
#endif

// y = T(x / rms(x) * (1 + w)), all in float32 before the one rounding (Gemma's RMSNorm: weights stored as offsets
// from one). x (N, E), w (E,), both of one dtype.
template <typename T>
void rms_norm_offset_impl(const T* x, const T* w, T* y, int64_t N, int64_t E, float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const T* xn = x + n * E;
    const float r = inv_rms(xn, E, eps);
    for (int64_t e = 0; e < E; ++e) y[n * E + e] = static_cast<T>(to_float(xn[e]) * r * (1.0f + to_float(w[e])));
  }
}

// y = T(gelu_tanh(gate)) * up (Gemma's GeGLU): gelu(x) = x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))), in
// float32, rounded to T before the product with up as torch rounds gelu's output. tanh(u) = 1 - 2 / (e^2u + 1), u
// clamped to [-9, 9] (tanh is +-1 there in float32). Each element by one formula wherever it sits (as silu_mul_impl).
template <typename T>
void gelu_tanh_mul_impl(const T* g, const T* u, T* y, int64_t n) {
  constexpr float C = 0.7978845608028654f, A = 0.044715f;
#if GQA_SIMD > 1
  const auto lanes = [](const T* gv, const T* uv, T* yv) {
    float tmp[LANES];
    const vec x = vload(gv);
    const vec inner = vmul(vset(2.0f * C), vfma(vmul(vset(A), vmul(x, x)), x, x));
    const vec e = vexp(vmin(vset(18.0f), vmax(vset(-18.0f), inner)));
    const vec t = vsub(vset(1.0f), vdiv(vset(2.0f), vadd(e, vset(1.0f))));
    vstore(tmp, vmul(vmul(vset(0.5f), x), vadd(vset(1.0f), t)));
    for (int j = 0; j < LANES; ++j) yv[j] = static_cast<T>(to_float(static_cast<T>(tmp[j])) * to_float(uv[j]));
  };
  gated_by_lanes(lanes, g, u, y, n);
#else
  for (int64_t i = 0; i < n; ++i) {
    const float x = to_float(g[i]);
    const float gelu = 0.5f * x * (1.0f + std::tanh(C * (x + A * x * x * x)));
    y[i] = static_cast<T>(to_float(static_cast<T>(gelu)) * to_float(u[i]));
  }
#endif
}

// y = T(silu(gate)) * up (SwiGLU) over n elements of gate and up of one dtype. Every element takes the same formula
// (with SIMD, a last partial vector is padded), so an element's value does not depend on n or on where it sits: a
// row computed alone equals the same row inside a batch, bit for bit.
template <typename T>
void silu_mul_impl(const T* g, const T* u, T* y, int64_t n) {
#if GQA_SIMD > 1
  // silu(x) = x * sigmoid(x), with e = exp(-|x|) (vexp takes arguments <= 0): sigmoid = 1 / (1 + e) for x >= 0,
  // e / (1 + e) for x < 0. The result is rounded to T before the product with up, as torch rounds silu's output.
  const auto lanes = [](const T* gv, const T* uv, T* yv) {
    float tmp[LANES];
    const vec x = vload(gv);
    const vec e = vexp(vmul(vset(-1.0f), vmax(x, vsub(vzero(), x))));
    const vec r = vdiv(vset(1.0f), vadd(vset(1.0f), e));
    vstore(tmp, vmul(x, vblend_negative(x, r, vmul(e, r))));
    for (int j = 0; j < LANES; ++j) yv[j] = static_cast<T>(to_float(static_cast<T>(tmp[j])) * to_float(uv[j]));
  };
  gated_by_lanes(lanes, g, u, y, n);
#else
  for (int64_t i = 0; i < n; ++i) {
    const float x = to_float(g[i]);
    y[i] = static_cast<T>(to_float(static_cast<T>(x / (1.0f + std::exp(-x)))) * to_float(u[i]));
  }
#endif
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

}  // namespace gqa_cpu
