// gqa CPU kernels, built once on the machine that runs them (see gqa/kernels/__init__.py).
//
//   gqa::linear_rows(x (N, K), weight (M, K), bias (M,)?) -> (N, M)
//       y = x @ weight^T + bias for a few rows N (decode): every thread streams its own slice of weight rows once,
//       all N rows of x at a time. nn.Linear's (out, in) layout is the streaming order, so no re-layout is needed.
//   gqa::linear_rows_n(x (N, K), weights [(M_i, K)], biases [(M_i,)?]) -> [(N, M_i)]
//       the same for several matrices of one input (q/k/v, gate/up) in one parallel region.
//
//   gqa::decode_attention(q (B, H_kv, R, D), k (B, H_kv, S, D), v (B, H_kv, S, Dv),
//                         mask (B, H_kv, G, L, S)?, scale, query_len L, causal, softcap = 0, sinks (H_kv * G)?)
//                         -> (B, H_kv, R, Dv)
//       The R = G * L query rows of one KV head (the whole group, all new tokens) attend to that head's keys in one
//       pass: each key and value row is read once for all R rows; softmax is online (running max and sum, float32),
//       the context is split into chunks so that both threads stream even for one head. k/v may be strided views of a
//       larger cache (only the last dim must be contiguous). The mask is any strided (often expanded, stride 0) view;
//       bool = allowed, float = added to the scores. causal: row r = g * L + l sees keys j <= S - L + l.
//       A row that sees no key returns zeros.
//
//   gqa::rms_norm, gqa::silu_mul, gqa::decode_attend (RoPE, the cache write and attention of one decoded token),
//   gqa::decode_layer (a whole decoder layer for one new token per row): the op-by-op decode step (decode_step.cpp
//   has the whole step in one call); the kernels themselves are in gemv.h, attention.h and layer_ops.h.
//
//   gqa::simd_width() -> int: float32 lanes the build vectorizes with (16 AVX-512, 8 AVX2 + FMA, 1 none).
//
// float32 and bfloat16 (all tensors one dtype; accumulation and softmax in float32). SIMD where the compiler targets
// it (-march=native): AVX-512 (16 lanes; vdpbf16ps for bf16 with AVX512-BF16) or AVX2 with FMA (8 lanes); plain loops
// otherwise. gqa::simd_width() says which was built.

#include "attention.h"
#include "gemv.h"
#include "layer_ops.h"
#include "paged.h"
#include "quantized.h"
#include "simd.h"

namespace {

using namespace gqa_cpu;

// ---------------------------------------------------------------------------------------------------------------
// linear_rows


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
      buf.resize(N * rows);
      gemv_rows<T>(wp, K, xp, N, rows, buf.data());
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < rows; ++i) {
          float v = buf[n * rows + i];
          if (bp) v += to_float(bp[m0 + i]);
          yp[n * M + m0 + i] = static_cast<T>(v);
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

template <typename T>
GroupedAttention<T> grouped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const MaskView& mask, float scale, int64_t L, bool causal,
                                      const int64_t* start) {
  GroupedAttention<T> a;
  a.q = q.const_data_ptr<T>(), a.k = k.const_data_ptr<T>(), a.v = v.const_data_ptr<T>();
  for (int d = 0; d < 3; ++d) a.qs[d] = q.stride(d), a.ks[d] = k.stride(d), a.vs[d] = v.stride(d);
  a.B = q.size(0), a.H = q.size(1), a.R = q.size(2), a.D = q.size(3), a.S = k.size(2), a.Dv = v.size(3), a.L = L;
  a.scale = scale, a.causal = causal, a.mask = mask, a.start = start;
  return a;
}

// a's tasks over at::parallel_for, then its rows combined into out (B * H_kv * R, Dv).
template <typename T>
void run_attention(GroupedAttention<T>& a, T* out) {
  a.plan(at::get_num_threads());
  std::vector<float> parts(a.part_floats());
  a.set_parts(parts.data());
  at::parallel_for(0, a.tasks(), 1, [&](int64_t t0, int64_t t1) {
    typename GroupedAttention<T>::Scratch scratch;
    for (int64_t t = t0; t < t1; ++t) a.task(t, scratch);
  });
  at::parallel_for(0, a.B * a.H * a.R, 64, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(a.Dv);
    for (int64_t i = i0; i < i1; ++i) a.combine(i, row.data(), out + i * a.Dv);
  });
}

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const MaskView& mask,
                           float scale, int64_t L, bool causal, at::Tensor& out, const int64_t* start = nullptr,
                           float softcap = 0.0f, const float* sinks = nullptr) {
  GroupedAttention<T> a = grouped_attention<T>(q, k, v, mask, scale, L, causal, start);
  a.softcap = softcap, a.sinks = sinks;
  run_attention(a, out.mutable_data_ptr<T>());
}

// decode_attention over a quantized cache: k and/or v uint8 rows of blocks (kv_blocks.h), format >= 0.
template <typename T>
void quantized_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t k_format,
                              int64_t v_format, int64_t Dv, const MaskView& mask, float scale, int64_t L, bool causal,
                              at::Tensor& out, float softcap, const float* sinks) {
  GroupedAttention<T> a;
  a.q = q.const_data_ptr<T>();
  if (k_format >= 0) a.k_blocks = k.const_data_ptr<uint8_t>(), a.k_format = k_format;
  else a.k = k.const_data_ptr<T>();
  if (v_format >= 0) a.v_blocks = v.const_data_ptr<uint8_t>(), a.v_format = v_format;
  else a.v = v.const_data_ptr<T>();
  for (int d = 0; d < 3; ++d) a.qs[d] = q.stride(d), a.ks[d] = k.stride(d), a.vs[d] = v.stride(d);
  a.B = q.size(0), a.H = q.size(1), a.R = q.size(2), a.D = q.size(3), a.S = k.size(2), a.Dv = Dv, a.L = L;
  a.scale = scale, a.causal = causal, a.mask = mask, a.start = nullptr, a.softcap = softcap, a.sinks = sinks;
  run_attention(a, out.mutable_data_ptr<T>());
}

// The feature size of a cache tensor's rows: its last dim, or the values its rows of `format` blocks hold.
int64_t cache_row_values(const at::Tensor& t, int64_t format, const char* name, const at::Tensor& q) {
  if (format < 0) {
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), "gqa::decode_attention: ", name, " must have q's dtype ",
                q.scalar_type(), " (or be uint8 blocks with a format), got ", t.scalar_type());
    return t.size(3);
  }
  TORCH_CHECK(kv_format_known(format), "gqa::decode_attention: ", name, "_format must be -1 (float), 0 (q8_0) or ",
              "1 (q4_0), got ", format);
  TORCH_CHECK(t.scalar_type() == at::kByte && t.size(3) % kv_block_bytes(format) == 0,
              "gqa::decode_attention: a quantized ", name, " must be uint8 rows of ", kv_block_bytes(format),
              "-byte blocks, got ", t.scalar_type(), " ", t.sizes());
  return t.size(3) / kv_block_bytes(format) * KV_BLOCK;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale, int64_t query_len, bool causal,
                            double softcap, const c10::optional<at::Tensor>& sinks, int64_t k_format,
                            int64_t v_format) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "gqa::decode_attention: q (B, H_kv, R, D), k (B, H_kv, S, D), v (B, H_kv, S, Dv) must be 4-D");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "gqa::decode_attention: the last dim of q, k, v must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), S = k.size(2);
  const int64_t Dk = cache_row_values(k, k_format, "k", q), Dv = cache_row_values(v, v_format, "v", q);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && v.size(0) == B && v.size(1) == H && v.size(2) == S &&
                  Dk == q.size(3),
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
  TORCH_CHECK(softcap >= 0.0, "gqa::decode_attention: softcap must be >= 0 (0: none), got ", softcap);
  const float* sink_logits = nullptr;
  if (sinks.has_value()) {
    const at::Tensor& sk = *sinks;
    TORCH_CHECK(sk.dim() == 1 && sk.size(0) == H * (R / query_len) && sk.scalar_type() == at::kFloat &&
                    sk.is_contiguous(),
                "gqa::decode_attention: sinks must be contiguous float32 (H_kv * G,), got ", sk.sizes());
    sink_logits = sk.const_data_ptr<float>();
  }
  at::Tensor out = at::empty({B, H, R, Dv}, q.options());
  if (S == 0 || B * H * R == 0) return out.zero_();  // no key: zeros, with sinks too (their values are zero)
  const float cap = softcap_float(softcap);
  if (k_format >= 0 || v_format >= 0) {
    if (q.scalar_type() == at::kFloat) {
      quantized_attention_impl<float>(q, k, v, k_format, v_format, Dv, mv, static_cast<float>(scale), query_len,
                                      causal, out, cap, sink_logits);
    } else {
      TORCH_CHECK(q.scalar_type() == at::kBFloat16, "gqa::decode_attention: float32 or bfloat16 only, got ",
                  q.scalar_type());
      quantized_attention_impl<BFloat16>(q, k, v, k_format, v_format, Dv, mv, static_cast<float>(scale), query_len,
                                         causal, out, cap, sink_logits);
    }
    return out;
  }
  if (q.scalar_type() == at::kFloat) {
    decode_attention_impl<float>(q, k, v, mv, static_cast<float>(scale), query_len, causal, out, nullptr, cap,
                                 sink_logits);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_attention_impl<BFloat16>(q, k, v, mv, static_cast<float>(scale), query_len, causal, out, nullptr, cap,
                                    sink_logits);
  } else {
    TORCH_CHECK(false, "gqa::decode_attention: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// paged_attention: decode attention over a paged cache (serving): row b's keys are the first lengths[b] slots of the
// blocks block_table[b] lists, in order, in a pool of blocks shared by every row.

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_pool, const at::Tensor& value_pool,
                           const at::Tensor& block_table, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "gqa::paged_attention: q must be (B, H_q, D) with contiguous rows");
  TORCH_CHECK(key_pool.dim() == 4 && value_pool.dim() == 4 && key_pool.stride(3) == 1 && value_pool.stride(3) == 1,
              "gqa::paged_attention: the pools must be (blocks, H_kv, block_size, D) with contiguous rows");
  TORCH_CHECK(q.scalar_type() == key_pool.scalar_type() && q.scalar_type() == value_pool.scalar_type(),
              "gqa::paged_attention: q and the pools must share a dtype");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), N = key_pool.size(0), Hkv = key_pool.size(1),
                bs = key_pool.size(2);
  TORCH_CHECK(key_pool.size(3) == D && value_pool.sizes().slice(0, 3) == key_pool.sizes().slice(0, 3),
              "gqa::paged_attention: shapes disagree: q ", q.sizes(), ", key_pool ", key_pool.sizes(),
              ", value_pool ", value_pool.sizes());
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, "gqa::paged_attention: H_q = ", Hq, " is not a multiple of H_kv = ", Hkv);
  check_block_table(block_table, lengths, B, N, bs, "gqa::paged_attention");
  at::Tensor out = at::empty({B, Hq, value_pool.size(3)}, q.options());
  if (B * Hq == 0) return out;
  const auto paged = [&](auto zero) {
    using T = decltype(zero);
    GroupedAttention<T> a;
    a.q = q.const_data_ptr<T>(), a.k = key_pool.const_data_ptr<T>(), a.v = value_pool.const_data_ptr<T>();
    a.qs[0] = q.stride(0), a.qs[1] = Hq / Hkv * q.stride(1), a.qs[2] = q.stride(1);  // q as (B, H_kv, G, D)
    for (int d = 0; d < 3; ++d) a.ks[d] = key_pool.stride(d), a.vs[d] = value_pool.stride(d);
    a.B = B, a.H = Hkv, a.R = Hq / Hkv, a.D = D, a.S = block_table.size(1) * bs, a.Dv = value_pool.size(3), a.L = 1;
    a.scale = static_cast<float>(scale), a.causal = false, a.mask = MaskView{}, a.start = nullptr;
    a.table = block_table.const_data_ptr<int64_t>(), a.table_stride = block_table.size(1), a.block = bs;
    a.lengths = lengths.const_data_ptr<int64_t>();
    run_attention(a, out.mutable_data_ptr<T>());
  };
  if (q.scalar_type() == at::kFloat) {
    paged(float{});
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "gqa::paged_attention: float32 or bfloat16 only, got ",
                q.scalar_type());
    paged(BFloat16{});
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// The rest of one decoded token's layer, each op one call instead of the handful of ATen ops (and their dispatch)
// it replaces; rounding to x's dtype happens where the eager PyTorch code rounds, so results match it.



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
  // Every check before the first write: a value cache smaller than the key cache would take the new V row outside it.
  TORCH_CHECK(value_cache.size(0) == B && value_cache.size(1) == H && value_cache.size(2) == C,
              "gqa::decode_attend: value_cache ", value_cache.sizes(), " must have key_cache's batch, heads and slots ",
              key_cache.sizes().slice(0, 3));
  TORCH_CHECK(D > 0 && D % 2 == 0, "gqa::decode_attend: head_dim must be positive and even for RoPE, got ", D);
  TORCH_CHECK(H > 0, "gqa::decode_attend: H_kv must be positive, got ", H);
  TORCH_CHECK(q.dim() == 2 && q.size(0) == B && q.size(1) % (D * H) == 0 && q.is_contiguous(),
              "gqa::decode_attend: q must be contiguous (B, H_q * D) with H_kv | H_q, got ", q.sizes());
  TORCH_CHECK(k.dim() == 2 && k.sizes() == at::IntArrayRef({B, H * D}) && k.is_contiguous() && v.dim() == 2 &&
                  v.sizes() == at::IntArrayRef({B, H * Dv}) && v.is_contiguous(),
              "gqa::decode_attend: k must be (B, H_kv * D) and v (B, H_kv * Dv), contiguous; got ", k.sizes(), ", ",
              v.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == key_cache.scalar_type() && q.scalar_type() == value_cache.scalar_type(),
              "gqa::decode_attend: q, k, v and the caches must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "gqa::decode_attend: float32 or bfloat16 only, got ", q.scalar_type());
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == at::IntArrayRef({B, D}) && sin.sizes() == cos.sizes(),
              "gqa::decode_attend: cos and sin must be contiguous float32 (B, D), got ", cos.sizes());
  TORCH_CHECK(start.scalar_type() == at::kLong && start.is_contiguous() && start.sizes() == at::IntArrayRef({B}) &&
                  cursor.scalar_type() == at::kLong && cursor.dim() == 0,
              "gqa::decode_attend: start must be int64 (B,) and cursor an int64 scalar");
  const int64_t pos = cursor.item<int64_t>();
  TORCH_CHECK(pos >= 0 && pos < C, "gqa::decode_attend: the cache is full (", C, " slots)");
  at::Tensor qr = at::empty_like(q);
  const int64_t G = q.size(1) / (D * H);
  at::Tensor out = at::empty({B, H, G, Dv}, q.options());
  if (B == 0) {  // an empty batch: nothing to write or attend (as PyTorch ops, an empty result)
    cursor.add_(1);
    return out.view({B, H * G * Dv});
  }
  if (q.scalar_type() == at::kFloat) {
    decode_attend_impl<float>(q, k, v, cos, sin, key_cache, value_cache, start, pos, static_cast<float>(scale), qr,
                              out);
  } else {
    decode_attend_impl<BFloat16>(q, k, v, cos, sin, key_cache, value_cache, start, pos, static_cast<float>(scale), qr,
                                 out);
  }
  cursor.add_(1);
  return out.view({B, H * G * Dv});
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

int64_t simd_width() { return GQA_SIMD; }

}  // namespace

TORCH_LIBRARY(gqa, m) {
  m.def("simd_width() -> int", &simd_width);  // no tensor arguments: one kernel for every backend
  m.def("linear_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_rows_n(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor[]");
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, int query_len, bool causal, "
      "float softcap=0., Tensor? sinks=None, int k_format=-1, int v_format=-1) -> Tensor");
  m.def(
      "paged_attention(Tensor q, Tensor key_pool, Tensor value_pool, Tensor block_table, Tensor lengths, "
      "float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def(
      "decode_attend(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor start, Tensor(c!) cursor, float scale) -> Tensor");
  m.def(
      "decode_layer(Tensor x, Tensor norm1, Tensor norm2, float eps, Tensor[] weights, int[] formats, "
      "Tensor?[] qkv_biases, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor start, "
      "Tensor(c!) cursor, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(gqa, CPU, m) {
  m.impl("linear_rows", &linear_rows);
  m.impl("linear_rows_n", &linear_rows_n);
  m.impl("decode_attention", &decode_attention);
  m.impl("paged_attention", &paged_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("decode_attend", &decode_attend);
  m.impl("decode_layer", &decode_layer);
}
