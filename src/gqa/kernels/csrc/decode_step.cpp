// gqa::decode_model: a whole decode step for one new token per row — every layer, the final norm and lm_head — in one
// call and one parallel region (team.h). Per layer, seven phases, each cut into chunks the threads claim:
//   1. q/k/v GEMV in chunks of whole heads (about 256 KB of weights each); a chunk ropes its q heads (into qr) or its
//      k heads (into the cache slot), or writes its v heads to the cache;
//   2. attention: (row, KV head, split of the context) tasks, as gqa::decode_attention cuts them;
//   3. o_proj GEMV and the residual add, in row chunks (Gemma: into a buffer, for phase 4);
//   4. Gemma only: per batch row, the attention output's norm added to the residual;
//   5. gate/up GEMV and silu(gate) * up (Gemma: gelu_tanh(gate) * up), chunks of matching gate and up rows;
//   6. down_proj GEMV and the residual add (Gemma: into the buffer);
//   7. Gemma only: per batch row, the MLP output's norm added to the residual;
// then lm_head in row chunks. What every chunk of a phase reads — the RMSNorm of the residual, the attention splits
// combined, and for block-quantized weights that input quantized to int8 — each thread computes for itself when it
// takes its first chunk of the phase: a few hundred values, cheaper than a phase of its own. Each value comes from the
// same code, in the same order, as in the op-by-op path (gqa::decode_layer per layer), so the logits are bitwise the
// same (tested).
//
//   gqa::decode_model(x (B, E), norms1 [(E,)], norms2 [(E,)], eps, weights [7 per layer: q, k, v, o, gate, up, down],
//                     formats [7 per layer: -1 float, else the block format], qkv_biases [3 per layer, or None],
//                     cos (B, D), sin (B, D), key_caches [(B, H_kv, C, D)], value_caches [(B, H_kv, C, Dv)],
//                     starts [(B,) int64], cursors [() int64], scale, final_norm (E,), final_eps, head (V, E) or
//                     blocks, head_format, greedy (B,) int64?) -> logits (B, V); each cache gets the new K/V at its
//                     cursor, cursor += 1; greedy, when given, gets each row's argmax (torch.argmax's, on the logits
//                     as returned: the first of equal maxima, NaN as the largest), found chunk by chunk in lm_head.
//                     Per-layer options, for the families beyond Llama's layer: qk_norms [2 per layer: q_norm, k_norm
//                     (D,)] (Qwen3, Gemma 3: each head's q and k RMS-normed, eps qk_eps, before RoPE), windows [per
//                     layer: keys a token sees to its left, -1 for all] (Mistral, sliding layers), rotates [per layer:
//                     0 for a layer without RoPE (SmolLM3's NoPE layers), 1 the cos/sin tables, 2 cos_local/sin_local
//                     (Gemma 3's sliding layers)]; empty lists: none of them. Gemma's layer: post_norms [2 per layer:
//                     after attention, after the MLP] (norms1 then the input norm, norms2 the one before the MLP),
//                     offset_norms (every norm scales by 1 + w, in float32), gelu (GELU-tanh gate), softcaps [per
//                     layer: attention-logit soft-capping, 0 for none]. reduce_group: a tensor-parallel rank's step
//                     (its weights the rank's shards) — the name of the torch.distributed group whose all-reduce sums
//                     each layer's o_proj and down_proj partial products inside the call (see decode_paged).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <string>

#include "attention.h"
#include "gemv.h"
#include "layer_ops.h"
#include "paged.h"
#include "quantized.h"
#include "simd.h"
#include "team.h"

#if __has_include(<torch/csrc/distributed/c10d/GroupRegistry.hpp>)
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#define GQA_HAS_C10D 1
#endif

namespace {

using namespace gqa_cpu;

// Seconds this process's decode_model / decode_paged calls spent in their all-reduces (waiting for the slowest rank included):
// gqa::reduce_seconds() reads it, for the share of a tensor-parallel step they take.
std::atomic<double> reduce_seconds_total{0.0};

double reduce_seconds() { return reduce_seconds_total.load(); }

// A weight matrix (M, K) as the step reads it: float rows of K values, or block-quantized rows.
struct Matrix {
  const void* w = nullptr;
  int64_t format = -1;  // -1 float, else the block format
  int64_t M = 0, K = 0;
  const void* bias = nullptr;  // (M,) or nullptr

  int64_t row_bytes(int64_t elem) const { return format < 0 ? K * elem : gqa::quantized_row_bytes(format, K); }
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bytes of weights per chunk: CHUNK_BYTES (twice that for big matrices, below), or less (not below MIN_CHUNK_BYTES)
// where that would leave a phase fewer chunks than threads. Each chunk a thread claims starts a new stream of weights
// for the hardware prefetchers and prefetch_ahead, and two threads claiming small chunks alternately restart theirs
// every chunk. One-row steps on 2 threads (medians of 12 alternating runs): SmolLM2 Q4_1 5.36 ms with 32 KB chunks,
// 5.05 with 64 KB, 4.42 with 128 KB; then 4.08 with 128 KB against 3.87 with 256 KB, and 4.03 with 256 KB against 4.53
// with 512 KB (too few chunks of its small matrices to balance two threads); the random 1B Q4_K_M model decoded at
// 46.9-49.7 tok/s with 128 KB, 49.1-50.6 with 256 KB, 50.4-53.0 with 512 KB. With many threads a phase of few big
// chunks would leave most idle. Hence twice CHUNK_BYTES for a matrix that still makes 8 such chunks per thread (the 1B
// model's MLP and lm_head: 46.3 against 42.9 tok/s, medians of 12 alternating runs; SmolLM2's lm_head only, 5.1-5.5 ms
// a step either way).
constexpr int64_t CHUNK_BYTES = 262144, MIN_CHUNK_BYTES = 32768;

// Rows of a weight row's bytes that make `bytes`, a multiple of 16, at least 16.
int64_t rows_of(const Matrix& m, int64_t elem, int64_t bytes) {
  return std::max<int64_t>(16, (bytes / std::max<int64_t>(1, m.row_bytes(elem)) + 15) / 16 * 16);
}

// Rows per chunk of a matrix that `threads` threads share: 2 * CHUNK_BYTES' worth where that makes at least 8 chunks
// per thread, else CHUNK_BYTES' worth, or about a thread's share of the rows where that is fewer chunks than threads
// (at least MIN_CHUNK_BYTES' worth).
int64_t chunk_rows(const Matrix& m, int64_t elem, int64_t threads) {
  const int64_t big = rows_of(m, elem, 2 * CHUNK_BYTES);
  if (ceil_div(m.M, big) >= 8 * threads) return big;
  const int64_t rows = rows_of(m, elem, CHUNK_BYTES);
  if (ceil_div(m.M, rows) >= threads) return rows;
  return std::min(rows, std::max(rows_of(m, elem, MIN_CHUNK_BYTES), (ceil_div(m.M, threads) + 15) / 16 * 16));
}

// A row's largest logit in a range and its first index; NaN counts as larger than any number (as torch.argmax has
// it), the first NaN winning.
struct Best {
  float value = -std::numeric_limits<float>::infinity();
  int64_t index = -1;

  void offer(float v, int64_t i) {
    if (index < 0 || (std::isnan(v) && !std::isnan(value)) || v > value) value = v, index = i;
  }
};

enum Phase : int {
  QKV = 0,
  ATTENTION = 1,
  O_PROJ = 2,
  POST_ATTENTION = 3,
  GATE_UP = 4,
  DOWN = 5,
  POST_MLP = 6,
  PHASES_PER_LAYER = 7
};

template <typename T>
struct Layer {
  const T *norm1, *norm2;
  const T *q_norm = nullptr, *k_norm = nullptr;  // per-head RMSNorm of q and k before RoPE, or none
  const T *post_attn_norm = nullptr, *post_ff_norm = nullptr;  // Gemma: norms of the attention and MLP outputs
  int64_t rope = 1;  // 0: no RoPE (a NoPE layer), 1: the cos/sin tables, 2: the local ones
  Matrix q, k, v, o, gate, up, down;
  T *key_cache, *value_cache;
  int64_t kc_stride[3], vc_stride[3];  // (B, H_kv, C) strides of the caches; paged: (block, H_kv, slot) of the pools
  // A quantized cache (kv_blocks.h): its rows of blocks (key_cache / value_cache unused), strides in bytes
  uint8_t *key_blocks = nullptr, *value_blocks = nullptr;
  int64_t k_format = -1, v_format = -1;
  const int64_t* start;
  int64_t pos;  // the slot this token's K/V go to
  const int64_t* table = nullptr;  // paged: (B, table_stride) block ids, and each row's slot for this token
  int64_t table_stride = 0, block = 0;
  const int64_t* positions = nullptr;

  // Where row b's new K (or V) of head h goes: an element offset into the float cache, or a byte offset into the
  // quantized one.
  int64_t slot_offset(bool key, int64_t b, int64_t h) const {
    const int64_t* st = key ? kc_stride : vc_stride;
    if (table == nullptr) return b * st[0] + h * st[1] + pos * st[2];
    const int64_t p = positions[b];
    return table[b * table_stride + p / block] * st[0] + h * st[1] + (p % block) * st[2];
  }
  T* slot(bool key, int64_t b, int64_t h) const { return (key ? key_cache : value_cache) + slot_offset(key, b, h); }
  // The quantized cache's format for K (key) or V, -1 for a float one.
  int64_t format(bool key) const { return key ? k_format : v_format; }
  GroupedAttention<T> attention;
  int64_t q_heads, k_heads, v_heads;  // heads per chunk of q, k and v
  int64_t o_rows, f_rows, down_rows;  // rows per chunk

  // The q/k/v phase's chunks: ceil(Hq / q_heads) of q, then of k, then of v.
  int64_t qkv_chunks(int64_t Hq, int64_t Hkv) const {
    return ceil_div(Hq, q_heads) + ceil_div(Hkv, k_heads) + ceil_div(Hkv, v_heads);
  }
};

// What each thread keeps for itself.
template <typename T>
struct ThreadState {
  std::vector<T> in;            // the phase's input (B, K): normed residual or combined attention output
  const T* input = nullptr;     // in.data(), or the shared SwiGLU output for down_proj
  gqa::QuantizedRows quantized;  // `input` quantized, when the phase's weights are blocks
  std::vector<float> sums, sums2, row;
  std::vector<T> rounded, rounded2, kv_row;  // kv_row: a new K/V row before it is quantized into the cache
  std::vector<float> kv_floats;
  typename GroupedAttention<T>::Scratch attention;
};

template <typename T>
struct Step {
  int64_t B, E, Hq, Hkv, D, Dv, F, V;
  float eps, final_eps, qk_eps = 0.0f;
  bool offset_norms = false, gelu = false;  // Gemma: norms scale by 1 + w; the gate's activation is GELU-tanh
  T* out = nullptr;  // (B, E) Gemma: o_proj's (then down_proj's) output, before its norm joins the residual;
                     // tensor parallelism: this rank's partial sums of it, before the all-reduce
  std::function<void()> reduce;  // tensor parallelism: sums `out` over the ranks in place (an all-reduce); or empty
  const float *cos_local = nullptr, *sin_local = nullptr;  // (B, D) RoPE of the layers with rope == 2
  T* x;           // (B, E) the residual stream, updated in place
  T* qr;          // (B, Hq * D) roped queries
  T* m;           // (B, F) silu(gate) * up
  T* logits;      // (NL, V)
  int64_t NL;     // rows that get logits: all B, or those listed in logit_rows
  const int64_t* logit_rows = nullptr;  // (NL,) rows of x, or nullptr for all
  Best* best = nullptr;  // (NL, lm_head chunks): each chunk's greedy pick per row, when asked for
  const float *cos, *sin;
  std::vector<Layer<T>> layers;
  const T* final_norm;
  Matrix head;
  int64_t head_rows;

  std::vector<int64_t> chunks() const {
    std::vector<int64_t> c;
    for (const Layer<T>& l : layers) {
      c.push_back(l.qkv_chunks(Hq, Hkv));
      c.push_back(l.attention.tasks());
      c.push_back(ceil_div(E, l.o_rows));
      c.push_back(l.post_attn_norm ? B : reduce ? 1 : 0);  // the all-reduce: one chunk, on one thread
      c.push_back(ceil_div(F, l.f_rows));
      c.push_back(ceil_div(E, l.down_rows));
      c.push_back(l.post_ff_norm ? B : reduce ? 1 : 0);
    }
    c.push_back(ceil_div(V, head_rows));
    return c;
  }

  // The thread's copy of the phase input: rms_norm(x, w), quantized too if `quantize`.
  // With `rows`, only those n rows of x, in that order (lm_head's logit_rows).
  void prepare_norm(ThreadState<T>& s, const T* w, float e, bool quantize, const int64_t* rows = nullptr,
                    int64_t n = -1) const {
    if (n < 0) n = B;
    s.in.resize(n * E);
    if (rows == nullptr) {
      norm(x, w, s.in.data(), n, E, e);
    } else {
      for (int64_t j = 0; j < n; ++j) norm(x + rows[j] * E, w, s.in.data() + j * E, 1, E, e);
    }
    s.input = s.in.data();
    if (quantize) s.quantized = gqa::quantize_input(s.input, n, E);
  }

  // The model's RMSNorm of n rows of width E: Llama's, or Gemma's (offset_norms).
  void norm(const T* in, const T* w, T* y, int64_t n, int64_t width, float e) const {
    if (offset_norms) {
      rms_norm_offset_impl<T>(in, w, y, n, width, e);
    } else {
      rms_norm_impl<T>(in, w, y, n, width, e);
    }
  }

  // sums (B, rows) = input @ W[m0 : m0 + rows]^T.
  // (n rows of input: B, or NL for lm_head)
  void gemv(ThreadState<T>& s, const Matrix& w, int64_t m0, int64_t rows, std::vector<float>& sums,
            int64_t n = -1) const {
    if (n < 0) n = B;
    sums.resize(n * rows);
    if (w.format < 0) {
      gemv_rows<T>(static_cast<const T*>(w.w) + m0 * w.K, w.K, s.input, n, rows, sums.data());
    } else {
      const int64_t rb = gqa::quantized_row_bytes(w.format, w.K);
      gqa::quantized_rows_dot(static_cast<const uint8_t*>(w.w) + m0 * rb, w.format, rows, w.K, s.quantized, s.input,
                              n, sums.data());
    }
  }

  // rounded (B, rows) = T(sums + bias), as the op-by-op GEMV writes its output.
  void round_out(const std::vector<float>& sums, const Matrix& w, int64_t m0, int64_t rows, std::vector<T>& rounded,
                 int64_t n = -1) const {
    if (n < 0) n = B;
    rounded.resize(n * rows);
    const T* bias = static_cast<const T*>(w.bias);
    for (int64_t b = 0; b < n; ++b)
      for (int64_t i = 0; i < rows; ++i) {
        float v = sums[b * rows + i];
        if (bias) v += to_float(bias[m0 + i]);
        rounded[b * rows + i] = static_cast<T>(v);
      }
  }

  // Chunk `c` of the q/k/v phase: heads [h0, h1) of q (the first ceil(Hq / q_heads) chunks), of k, or of v; their
  // rows through one GEMV, then per head RoPE (and the head norm) and the write to qr or the cache.
  void qkv_chunk(ThreadState<T>& s, const Layer<T>& l, int64_t c) const {
    const int64_t nq = ceil_div(Hq, l.q_heads), nk = ceil_div(Hkv, l.k_heads);
    const bool is_q = c < nq, is_k = !is_q && c < nq + nk;
    const Matrix& w = is_q ? l.q : is_k ? l.k : l.v;
    const int64_t per = is_q ? l.q_heads : is_k ? l.k_heads : l.v_heads;
    const int64_t h0 = (is_q ? c : is_k ? c - nq : c - nq - nk) * per, h1 = std::min(h0 + per, is_q ? Hq : Hkv);
    const int64_t width = is_q || is_k ? D : Dv, rows = (h1 - h0) * width;
    gemv(s, w, h0 * width, rows, s.sums);
    round_out(s.sums, w, h0 * width, rows, s.rounded);
    const T* head_norm = is_q ? l.q_norm : is_k ? l.k_norm : nullptr;
    if (head_norm != nullptr) s.rounded2.resize(D);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = h0; h < h1; ++h) {
        const T* r = s.rounded.data() + b * rows + (h - h0) * width;
        if (head_norm != nullptr) {  // as the op-by-op path's rms_norm of the head's row
          this->norm(r, head_norm, s.rounded2.data(), 1, D, qk_eps);
          r = s.rounded2.data();
        }
        const int64_t format = is_q ? -1 : l.format(is_k);
        if (format >= 0) s.kv_row.resize(width);
        T* dst = is_q ? qr + (b * Hq + h) * D : format >= 0 ? s.kv_row.data() : l.slot(is_k, b, h);
        if (!is_q && !is_k) {
          std::copy(r, r + Dv, dst);
        } else if (l.rope == 0) {
          std::copy(r, r + D, dst);
        } else {
          const float *cs = l.rope == 2 ? cos_local : cos, *sn = l.rope == 2 ? sin_local : sin;
          rope_row(r, cs + b * D, sn + b * D, dst, D);
        }
        if (format >= 0) {  // the row as the model's dtype has it, then quantized once, into its slot
          s.kv_floats.resize(width);
          for (int64_t d = 0; d < width; ++d) s.kv_floats[d] = to_float(dst[d]);
          if (is_k) rotate_kv_row(s.kv_floats.data(), width);  // K is stored rotated (kv_blocks.h)
          quantize_kv_row(s.kv_floats.data(), width, format,
                          (is_k ? l.key_blocks : l.value_blocks) + l.slot_offset(is_k, b, h));
        }
      }
  }

  // Rows [m0, m0 + rows) of o_proj or down_proj, added to the residual: x = T(x + T(sum)); with `post` (Gemma),
  // written to `out` instead, for post_chunk.
  void residual_chunk(ThreadState<T>& s, const Matrix& w, int64_t m0, int64_t rows, bool post) const {
    gemv(s, w, m0, rows, s.sums);
    round_out(s.sums, w, m0, rows, s.rounded);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < rows; ++i) {
        if (post) {
          out[b * E + m0 + i] = s.rounded[b * rows + i];
          continue;
        }
        T& xi = x[b * E + m0 + i];
        xi = static_cast<T>(to_float(xi) + to_float(s.rounded[b * rows + i]));
      }
  }

  // Tensor parallelism: `out` summed over the ranks, then x = T(x + out), as the op-by-op path adds the all-reduced
  // partial product (the same bits).
  void reduce_chunk() const {
    reduce();
    for (int64_t i = 0; i < B * E; ++i) x[i] = static_cast<T>(to_float(x[i]) + to_float(out[i]));
  }

  // Batch row b of Gemma's sandwich: x = T(x + norm(out)).
  void post_chunk(ThreadState<T>& s, const T* w, int64_t b) const {
    s.rounded.resize(E);
    norm(out + b * E, w, s.rounded.data(), 1, E, eps);
    for (int64_t i = 0; i < E; ++i) x[b * E + i] = static_cast<T>(to_float(x[b * E + i]) + to_float(s.rounded[i]));
  }

  // Rows [m0, m0 + rows) of gate and up: m = T(silu(gate)) * up.
  void gate_up_chunk(ThreadState<T>& s, const Layer<T>& l, int64_t m0, int64_t rows) const {
    gemv(s, l.gate, m0, rows, s.sums);
    gemv(s, l.up, m0, rows, s.sums2);
    round_out(s.sums, l.gate, m0, rows, s.rounded);
    round_out(s.sums2, l.up, m0, rows, s.rounded2);
    for (int64_t b = 0; b < B; ++b) {  // each element by one formula, wherever it is: a row alone or batched
      if (gelu) {
        gelu_tanh_mul_impl(s.rounded.data() + b * rows, s.rounded2.data() + b * rows, m + b * F + m0, rows);
      } else {
        silu_mul_impl(s.rounded.data() + b * rows, s.rounded2.data() + b * rows, m + b * F + m0, rows);
      }
    }
  }

  void run_chunk(ThreadState<T>& s, size_t phase, int64_t c, bool first) const {
    if (phase == layers.size() * PHASES_PER_LAYER) {  // lm_head, for the NL rows asked for
      if (first) prepare_norm(s, final_norm, final_eps, head.format >= 0, logit_rows, NL);
      const int64_t m0 = c * head_rows, rows = std::min(head_rows, V - m0);
      gemv(s, head, m0, rows, s.sums, NL);
      round_out(s.sums, head, m0, rows, s.rounded, NL);
      for (int64_t b = 0; b < NL; ++b) {
        const T* r = s.rounded.data() + b * rows;
        std::copy(r, r + rows, logits + b * V + m0);
        if (best == nullptr) continue;
        Best& pick = best[b * ceil_div(V, head_rows) + c];
        for (int64_t i = 0; i < rows; ++i) pick.offer(to_float(r[i]), m0 + i);
      }
      return;
    }
    const Layer<T>& l = layers[phase / PHASES_PER_LAYER];
    switch (phase % PHASES_PER_LAYER) {
      case QKV:
        if (first) prepare_norm(s, l.norm1, eps, l.q.format >= 0 || l.k.format >= 0 || l.v.format >= 0);
        qkv_chunk(s, l, c);
        break;
      case ATTENTION:
        l.attention.task(c, s.attention);
        break;
      case O_PROJ: {
        if (first) {  // the attention output (B, H_kv, G, Dv) = (B, Hq * Dv), splits combined
          s.in.resize(B * Hq * Dv);
          s.row.resize(Dv);
          for (int64_t i = 0; i < B * Hq; ++i) l.attention.combine(i, s.row.data(), s.in.data() + i * Dv);
          s.input = s.in.data();
          if (l.o.format >= 0) s.quantized = gqa::quantize_input(s.input, B, Hq * Dv);
        }
        const int64_t m0 = c * l.o_rows;
        residual_chunk(s, l.o, m0, std::min(l.o_rows, E - m0), l.post_attn_norm != nullptr || reduce);
        break;
      }
      case POST_ATTENTION:
        reduce ? reduce_chunk() : post_chunk(s, l.post_attn_norm, c);
        break;
      case POST_MLP:
        reduce ? reduce_chunk() : post_chunk(s, l.post_ff_norm, c);
        break;
      case GATE_UP: {
        if (first) prepare_norm(s, l.norm2, eps, l.gate.format >= 0 || l.up.format >= 0);
        const int64_t m0 = c * l.f_rows;
        gate_up_chunk(s, l, m0, std::min(l.f_rows, F - m0));
        break;
      }
      default: {  // DOWN
        if (first) {
          s.input = m;
          if (l.down.format >= 0) s.quantized = gqa::quantize_input(m, B, F);
        }
        const int64_t m0 = c * l.down_rows;
        residual_chunk(s, l.down, m0, std::min(l.down_rows, E - m0), l.post_ff_norm != nullptr || reduce);
      }
    }
  }
};

Matrix matrix(const at::Tensor& w, int64_t format, int64_t K, const c10::optional<at::Tensor>& bias,
              at::ScalarType dtype, const char* name, int64_t layer) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "gqa::decode_model: layer ", layer, " ", name,
              " must be a contiguous matrix, got ", w.sizes());
  if (format < 0) {
    TORCH_CHECK(w.scalar_type() == dtype && w.size(1) == K, "gqa::decode_model: layer ", layer, " ", name,
                " must be (M, ", K, ") of x's dtype, got ", w.sizes(), " ", w.scalar_type());
  } else {
    TORCH_CHECK(K % 32 == 0, "gqa::decode_model: layer ", layer, " ", name, ": K = ", K,
                " is not a multiple of the block size 32");
    TORCH_CHECK(w.scalar_type() == at::kByte && w.size(1) == gqa::quantized_row_bytes(format, K),
                "gqa::decode_model: layer ", layer, " ", name, " blocks must be uint8 (M, ",
                gqa::quantized_row_bytes(format, K), "), got ", w.sizes());
  }
  Matrix m{w.const_data_ptr(), format, w.size(0), K, nullptr};
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == m.M && bias->is_contiguous() && bias->scalar_type() == dtype,
                "gqa::decode_model: layer ", layer, " ", name, " bias must be contiguous (", m.M,
                ",) of x's dtype, got ", bias->sizes());
    m.bias = bias->const_data_ptr();
  }
  return m;
}

// Where the step's K/V are: per-row caches with a start and a cursor per layer (decode_model), or per-layer pools of
// blocks with a block table and a position per row (decode_paged).
struct Caches {
  at::TensorList keys, values;
  at::TensorList starts, cursors;                  // dense
  const at::Tensor* table = nullptr;               // paged: (B, max_blocks) int64
  const at::Tensor* positions = nullptr;           // paged: (B,) int64, the new token's slot per row
  at::Tensor lengths;                              // paged: positions + 1
  int64_t k_format = -1, v_format = -1;            // quantized caches' block formats (kv_blocks.h), -1: float
};

// The per-layer options (see the top of the file).
struct LayerOptions {
  c10::optional<at::TensorList> qk_norms;
  double qk_eps = 0.0;
  at::IntArrayRef windows, rotates;
  c10::optional<at::TensorList> post_norms;  // Gemma
  bool offset_norms = false, gelu = false;
  at::ArrayRef<double> softcaps;
  c10::optional<at::Tensor> cos_local, sin_local;
  std::string reduce_group;  // tensor parallelism: the torch.distributed group summing o_proj's and down_proj's
                             // partial products (its name); empty: none
};

template <typename T>
at::Tensor decode_model_impl(const at::Tensor& x, at::TensorList norms1, at::TensorList norms2, double eps,
                             at::TensorList weights, at::IntArrayRef formats,
                             const c10::List<c10::optional<at::Tensor>>& qkv_biases, const at::Tensor& cos,
                             const at::Tensor& sin, Caches& caches, double scale, const at::Tensor& final_norm,
                             double final_eps, const at::Tensor& head, int64_t head_format,
                             const c10::optional<at::Tensor>& greedy, const c10::optional<at::Tensor>& logit_rows,
                             const LayerOptions& options) {
  at::TensorList key_caches = caches.keys, value_caches = caches.values;
  const bool paged = caches.table != nullptr;
  const at::ScalarType dtype = x.scalar_type();
  const int64_t elem = static_cast<int64_t>(sizeof(T));
  Step<T> st;
  st.B = x.size(0), st.E = x.size(1);
  const at::Tensor& kc0 = key_caches[0];
  TORCH_CHECK(kc0.dim() == 4 && value_caches[0].dim() == 4, "gqa::decode_model: caches must be (B, H_kv, C, D)");
  st.Hkv = kc0.size(1), st.D = kc0.size(3), st.Dv = value_caches[0].size(3);
  for (const int64_t f : {caches.k_format, caches.v_format})
    TORCH_CHECK(f == -1 || kv_format_known(f), "gqa::decode_model: kv_formats must be -1 (float), 0 (q8_0) or 1 ",
                "(q4_0), got ", f);
  // A quantized cache's rows are bytes: the head sizes come from k_proj's and v_proj's rows.
  if (caches.k_format >= 0 && st.Hkv > 0) st.D = weights[1].size(0) / st.Hkv;
  if (caches.v_format >= 0 && st.Hkv > 0) st.Dv = weights[2].size(0) / st.Hkv;
  const int64_t k_row = caches.k_format >= 0 ? kv_row_bytes(caches.k_format, st.D) : st.D;
  const int64_t v_row = caches.v_format >= 0 ? kv_row_bytes(caches.v_format, st.Dv) : st.Dv;
  for (const auto& [f, n] : {std::pair{caches.k_format, st.D}, std::pair{caches.v_format, st.Dv}})
    TORCH_CHECK(f < 0 || (n > 0 && n % KV_BLOCK == 0), "gqa::decode_model: a quantized cache needs head sizes that ",
                "are multiples of 32, got ", n);
  TORCH_CHECK(st.D > 0 && st.D % 2 == 0, "gqa::decode_model: head_dim must be positive and even for RoPE, got ", st.D);
  TORCH_CHECK(st.Hkv > 0, "gqa::decode_model: H_kv must be positive, got ", st.Hkv);
  st.Hq = weights[0].size(0) / st.D;
  st.F = weights[4].size(0), st.V = head.size(0);
  st.eps = static_cast<float>(eps), st.final_eps = static_cast<float>(final_eps);
  st.qk_eps = static_cast<float>(options.qk_eps);
  const int64_t n_layers = static_cast<int64_t>(norms1.size());
  TORCH_CHECK(!options.qk_norms.has_value() || static_cast<int64_t>(options.qk_norms->size()) == 2 * n_layers,
              "gqa::decode_model: qk_norms must hold 2 norms per layer (", 2 * n_layers, "), got ",
              options.qk_norms->size());
  TORCH_CHECK(options.windows.empty() || static_cast<int64_t>(options.windows.size()) == n_layers,
              "gqa::decode_model: windows must be empty or one per layer (", n_layers, "), got ",
              options.windows.size());
  TORCH_CHECK(options.rotates.empty() || static_cast<int64_t>(options.rotates.size()) == n_layers,
              "gqa::decode_model: rotates must be empty or one per layer (", n_layers, "), got ",
              options.rotates.size());
  TORCH_CHECK(!options.post_norms.has_value() || static_cast<int64_t>(options.post_norms->size()) == 2 * n_layers,
              "gqa::decode_model: post_norms must hold 2 norms per layer (", 2 * n_layers, "), got ",
              options.post_norms->size());
  TORCH_CHECK(options.softcaps.empty() || static_cast<int64_t>(options.softcaps.size()) == n_layers,
              "gqa::decode_model: softcaps must be empty or one per layer (", n_layers, "), got ",
              options.softcaps.size());
  st.offset_norms = options.offset_norms, st.gelu = options.gelu;
  for (int64_t li = 0; li < static_cast<int64_t>(options.rotates.size()); ++li) {
    TORCH_CHECK(options.rotates[li] >= 0 && options.rotates[li] <= 2, "gqa::decode_model: layer ", li,
                "'s rotates must be 0, 1 or 2, got ", options.rotates[li]);
    TORCH_CHECK(options.rotates[li] != 2 || (options.cos_local.has_value() && options.sin_local.has_value()),
                "gqa::decode_model: layer ", li, " rotates with the local tables: cos_local and sin_local needed");
  }
  if (options.cos_local.has_value() || options.sin_local.has_value()) {
    TORCH_CHECK(options.cos_local.has_value() && options.sin_local.has_value(),
                "gqa::decode_model: cos_local and sin_local go together");
    for (const at::Tensor* t : {&*options.cos_local, &*options.sin_local})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == cos.sizes(),
                  "gqa::decode_model: cos_local and sin_local must be contiguous float32 like cos, got ", t->sizes());
    st.cos_local = options.cos_local->const_data_ptr<float>(), st.sin_local = options.sin_local->const_data_ptr<float>();
  }
  TORCH_CHECK(st.Hq % st.Hkv == 0 && st.Hq * st.D == weights[0].size(0), "gqa::decode_model: q_proj has ",
              weights[0].size(0), " rows, not a multiple of H_kv * head_dim = ", st.Hkv * st.D);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == at::IntArrayRef({st.B, st.D}) && sin.sizes() == cos.sizes(),
              "gqa::decode_model: cos and sin must be contiguous float32 (B, D), got ", cos.sizes());
  const int64_t threads = at::get_num_threads();
  int64_t part_floats = 0, max_length = 0;
  if (paged) {
    const at::Tensor& pos = *caches.positions;
    TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() && pos.sizes() == at::IntArrayRef({st.B}) &&
                    (st.B == 0 || pos.min().item<int64_t>() >= 0),
                "gqa::decode_paged: positions must be a contiguous int64 (B,) tensor of slots >= 0, got ",
                pos.sizes(), " ", pos.scalar_type());
    check_block_table(*caches.table, caches.lengths = *caches.positions + 1, st.B, kc0.size(0), kc0.size(2),
                      "gqa::decode_paged");
    for (int64_t b = 0; b < st.B; ++b) max_length = std::max(max_length, caches.lengths.data_ptr<int64_t>()[b]);
  }
  for (size_t i = 0; i < norms1.size(); ++i) {
    const int64_t li = static_cast<int64_t>(i);
    const at::Tensor &kc = key_caches[i], &vc = value_caches[i];
    const int64_t rows = paged ? kc0.size(0) : st.B;  // dim 0: blocks or batch rows
    TORCH_CHECK(kc.dim() == 4 && vc.dim() == 4 && kc.stride(3) == 1 && vc.stride(3) == 1 && kc.size(0) == rows &&
                    vc.size(0) == rows && kc.size(1) == st.Hkv && vc.size(1) == st.Hkv && kc.size(3) == k_row &&
                    vc.size(3) == v_row && vc.size(2) == kc.size(2) && (!paged || kc.size(2) == kc0.size(2)) &&
                    kc.scalar_type() == (caches.k_format >= 0 ? at::kByte : dtype) &&
                    vc.scalar_type() == (caches.v_format >= 0 ? at::kByte : dtype),
                "gqa::", paged ? "decode_paged" : "decode_model", ": layer ", li, "'s caches must be ",
                paged ? "(blocks, H_kv, block_size, D)" : "(B, H_kv, C, D)",
                " of x's dtype (uint8 rows of blocks where kv_formats says so) with contiguous rows, like layer 0's ",
                "(dense caches: of any length); got ", kc.sizes(), " ", kc.scalar_type(), " and ", vc.sizes(), " ",
                vc.scalar_type());
    if (!paged) {
      const at::Tensor &start = caches.starts[i], &cursor = caches.cursors[i];
      TORCH_CHECK(start.scalar_type() == at::kLong && start.is_contiguous() &&
                      start.sizes() == at::IntArrayRef({st.B}) && cursor.scalar_type() == at::kLong &&
                      cursor.dim() == 0,
                  "gqa::decode_model: start must be int64 (B,) and cursor an int64 scalar");
    }
    for (const at::Tensor& n : {norms1[i], norms2[i]})
      TORCH_CHECK(n.dim() == 1 && n.size(0) == st.E && n.is_contiguous() && n.scalar_type() == dtype,
                  "gqa::decode_model: layer ", li, "'s norms must be contiguous (E,) of x's dtype");
    Layer<T> l;
    l.norm1 = norms1[i].const_data_ptr<T>(), l.norm2 = norms2[i].const_data_ptr<T>();
    if (options.qk_norms.has_value()) {
      const at::Tensor &qn = (*options.qk_norms)[2 * i], &kn = (*options.qk_norms)[2 * i + 1];
      for (const at::Tensor* n : {&qn, &kn})
        TORCH_CHECK(n->dim() == 1 && n->size(0) == st.D && n->is_contiguous() && n->scalar_type() == dtype,
                    "gqa::decode_model: layer ", li, "'s q/k norms must be contiguous (head_dim,) of x's dtype, got ",
                    n->sizes());
      l.q_norm = qn.const_data_ptr<T>(), l.k_norm = kn.const_data_ptr<T>();
    }
    if (!options.rotates.empty()) l.rope = options.rotates[i];
    if (options.post_norms.has_value()) {
      const at::Tensor &pa = (*options.post_norms)[2 * i], &pf = (*options.post_norms)[2 * i + 1];
      for (const at::Tensor* n : {&pa, &pf})
        TORCH_CHECK(n->dim() == 1 && n->size(0) == st.E && n->is_contiguous() && n->scalar_type() == dtype,
                    "gqa::decode_model: layer ", li, "'s post norms must be contiguous (E,) of x's dtype, got ",
                    n->sizes());
      l.post_attn_norm = pa.const_data_ptr<T>(), l.post_ff_norm = pf.const_data_ptr<T>();
    }
    const int64_t* f = formats.data() + 7 * i;
    const at::Tensor* w = weights.data() + 7 * i;
    const c10::optional<at::Tensor> none;
    l.q = matrix(w[0], f[0], st.E, qkv_biases.get(3 * i), dtype, "q_proj", li);
    l.k = matrix(w[1], f[1], st.E, qkv_biases.get(3 * i + 1), dtype, "k_proj", li);
    l.v = matrix(w[2], f[2], st.E, qkv_biases.get(3 * i + 2), dtype, "v_proj", li);
    l.o = matrix(w[3], f[3], st.Hq * st.Dv, none, dtype, "o_proj", li);
    l.gate = matrix(w[4], f[4], st.E, none, dtype, "gate_proj", li);
    l.up = matrix(w[5], f[5], st.E, none, dtype, "up_proj", li);
    l.down = matrix(w[6], f[6], st.F, none, dtype, "down_proj", li);
    TORCH_CHECK(l.q.M == st.Hq * st.D && l.k.M == st.Hkv * st.D && l.v.M == st.Hkv * st.Dv && l.o.M == st.E &&
                    l.gate.M == st.F && l.up.M == st.F && l.down.M == st.E,
                "gqa::decode_model: layer ", li, "'s projections disagree with layer 0's shapes");
    l.k_format = caches.k_format, l.v_format = caches.v_format;
    if (l.k_format >= 0) l.key_blocks = kc.mutable_data_ptr<uint8_t>();
    else l.key_cache = kc.mutable_data_ptr<T>();
    if (l.v_format >= 0) l.value_blocks = vc.mutable_data_ptr<uint8_t>();
    else l.value_cache = vc.mutable_data_ptr<T>();
    for (int d = 0; d < 3; ++d) l.kc_stride[d] = kc.stride(d), l.vc_stride[d] = vc.stride(d);
    if (paged) {
      l.start = nullptr, l.pos = -1;
      l.table = caches.table->const_data_ptr<int64_t>(), l.table_stride = caches.table->size(1);
      l.block = kc.size(2), l.positions = caches.positions->const_data_ptr<int64_t>();
    } else {
      l.start = caches.starts[i].const_data_ptr<int64_t>();
      l.pos = caches.cursors[i].item<int64_t>();
      TORCH_CHECK(l.pos >= 0 && l.pos < kc.size(2), "gqa::decode_model: layer ", li, "'s cache is full (",
                  kc.size(2), " slots)");
    }
    // whole heads per q/k/v chunk, CHUNK_BYTES' worth; a head each where that leaves fewer chunks than threads
    l.q_heads = std::clamp<int64_t>(rows_of(l.q, elem, CHUNK_BYTES) / st.D, 1, st.Hq);
    l.k_heads = std::clamp<int64_t>(rows_of(l.k, elem, CHUNK_BYTES) / st.D, 1, st.Hkv);
    l.v_heads = std::clamp<int64_t>(rows_of(l.v, elem, CHUNK_BYTES) / st.Dv, 1, st.Hkv);
    if (l.qkv_chunks(st.Hq, st.Hkv) < threads) l.q_heads = l.k_heads = l.v_heads = 1;
    l.o_rows = chunk_rows(l.o, elem, threads);
    l.f_rows = std::max<int64_t>(16, chunk_rows(l.gate, elem, threads) / 32 * 16);  // gate and up rows: same bytes
    l.down_rows = chunk_rows(l.down, elem, threads);
    // The attention reads the roped queries (B, H_kv, G, D) and the cache's slots [0, pos].
    GroupedAttention<T>& a = l.attention;
    a.q = nullptr, a.k = l.key_cache, a.v = l.value_cache;
    a.k_blocks = l.key_blocks, a.v_blocks = l.value_blocks, a.k_format = l.k_format, a.v_format = l.v_format;
    a.qs[0] = st.Hq * st.D, a.qs[1] = st.Hq / st.Hkv * st.D, a.qs[2] = st.D;
    for (int d = 0; d < 3; ++d) a.ks[d] = l.kc_stride[d], a.vs[d] = l.vc_stride[d];
    a.B = st.B, a.H = st.Hkv, a.R = st.Hq / st.Hkv, a.D = st.D, a.S = paged ? max_length : l.pos + 1;
    a.Dv = st.Dv, a.L = 1, a.scale = static_cast<float>(scale), a.causal = false, a.mask = MaskView{};
    a.start = l.start;
    if (!options.windows.empty()) {
      TORCH_CHECK(options.windows[i] >= -1, "gqa::decode_model: layer ", li, "'s window must be >= 0 or -1, got ",
                  options.windows[i]);
      a.window = options.windows[i];
    }
    if (!options.softcaps.empty()) {
      TORCH_CHECK(options.softcaps[i] >= 0.0, "gqa::decode_model: layer ", li, "'s softcap must be >= 0, got ",
                  options.softcaps[i]);
      a.softcap = softcap_float(options.softcaps[i]);
    }
    if (paged) {
      a.table = l.table, a.table_stride = l.table_stride, a.block = l.block;
      a.lengths = caches.lengths.const_data_ptr<int64_t>();
    }
    a.plan(threads);
    part_floats = std::max(part_floats, a.part_floats());
    st.layers.push_back(l);
  }
  TORCH_CHECK(final_norm.dim() == 1 && final_norm.size(0) == st.E && final_norm.is_contiguous() &&
                  final_norm.scalar_type() == dtype,
              "gqa::decode_model: final_norm must be contiguous (E,) of x's dtype");
  st.final_norm = final_norm.const_data_ptr<T>();
  st.head = matrix(head, head_format, st.E, c10::nullopt, dtype, "lm_head", -1);
  st.head_rows = chunk_rows(st.head, elem, threads);
  st.NL = st.B;
  if (logit_rows.has_value()) {
    const at::Tensor& lr = *logit_rows;
    TORCH_CHECK(lr.scalar_type() == at::kLong && lr.dim() == 1 && lr.is_contiguous(),
                "gqa::decode_paged: logit_rows must be a contiguous int64 (N,) tensor, got ", lr.sizes(), " ",
                lr.scalar_type());
    st.NL = lr.size(0), st.logit_rows = lr.const_data_ptr<int64_t>();
    for (int64_t j = 0; j < st.NL; ++j)
      TORCH_CHECK(st.logit_rows[j] >= 0 && st.logit_rows[j] < st.B, "gqa::decode_paged: logit_rows[", j, "] = ",
                  st.logit_rows[j], " is not a row of x (B = ", st.B, ")");
  }
  if (greedy.has_value())
    TORCH_CHECK(greedy->scalar_type() == at::kLong && greedy->is_contiguous() &&
                    greedy->sizes() == at::IntArrayRef({st.NL}),
                "gqa::decode_model: greedy must be a contiguous int64 tensor of a value per row with logits (",
                st.NL, ",), got ", greedy->sizes());
  std::vector<Best> best(greedy.has_value() ? st.NL * ceil_div(st.V, st.head_rows) : 0);
  st.best = greedy.has_value() ? best.data() : nullptr;

  if (st.B == 0) {  // an empty batch: nothing to write or compute (as PyTorch ops, an empty result)
    for (const at::Tensor& cursor : caches.cursors) const_cast<at::Tensor&>(cursor).add_(1);
    return at::empty({0, st.V}, x.options());
  }
  at::Tensor h = x.clone();
  at::Tensor qr = at::empty({st.B, st.Hq * st.D}, x.options());
  at::Tensor m = at::empty({st.B, st.F}, x.options());
  const bool reducing = !options.reduce_group.empty();
  TORCH_CHECK(!reducing || !options.post_norms.has_value(),
              "gqa::decode_model: reduce_group (tensor parallelism) takes Llama's layers, not Gemma's post norms");
  at::Tensor post_out =
      options.post_norms.has_value() || reducing ? at::empty({st.B, st.E}, x.options()) : at::Tensor();
  if (reducing) {
#ifdef GQA_HAS_C10D
    auto group = c10d::resolve_process_group(options.reduce_group);  // raises for a group it does not know
    st.reduce = [group, post_out] {
      const auto start = std::chrono::steady_clock::now();
      std::vector<at::Tensor> sums{post_out};
      group->allreduce(sums)->wait();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      double seen = reduce_seconds_total.load();
      while (!reduce_seconds_total.compare_exchange_weak(seen, seen + seconds)) {
      }
    };
#else
    TORCH_CHECK(false, "gqa::decode_model: reduce_group needs torch.distributed, which this torch was built without");
#endif
  }
  at::Tensor logits = at::empty({st.NL, st.V}, x.options());
  std::vector<float> parts(part_floats);
  st.x = h.mutable_data_ptr<T>(), st.qr = qr.mutable_data_ptr<T>(), st.m = m.mutable_data_ptr<T>();
  if (post_out.defined()) st.out = post_out.mutable_data_ptr<T>();
  st.logits = logits.mutable_data_ptr<T>();
  st.cos = cos.const_data_ptr<float>(), st.sin = sin.const_data_ptr<float>();
  for (Layer<T>& l : st.layers) {
    l.attention.q = st.qr;
    l.attention.set_parts(parts.data());  // layers run one after the other: one buffer for all
  }
  PhasedWork work(st.chunks());
  work.run<ThreadState<T>>(
      [&](ThreadState<T>& s, size_t phase, int64_t c, bool first) { st.run_chunk(s, phase, c, first); });
  for (const at::Tensor& cursor : caches.cursors) const_cast<at::Tensor&>(cursor).add_(1);
  if (greedy.has_value()) {  // the chunks in order: the first of equal maxima wins, as in torch.argmax
    const int64_t chunks = ceil_div(st.V, st.head_rows);
    int64_t* out = greedy->mutable_data_ptr<int64_t>();
    for (int64_t b = 0; b < st.NL; ++b) {
      Best pick;
      for (int64_t c = 0; c < chunks; ++c) pick.offer(best[b * chunks + c].value, best[b * chunks + c].index);
      out[b] = pick.index;
    }
  }
  return logits;
}

// kv_formats: [] (float caches) or [K's format, V's format] (-1 float, else a block format of kv_blocks.h).
void set_kv_formats(Caches& caches, at::IntArrayRef kv_formats) {
  TORCH_CHECK(kv_formats.empty() || kv_formats.size() == 2,
              "gqa::decode_model: kv_formats must be [] or [K's format, V's format], got ", kv_formats);
  if (!kv_formats.empty()) caches.k_format = kv_formats[0], caches.v_format = kv_formats[1];
}

at::Tensor dispatch(const at::Tensor& x, at::TensorList norms1, at::TensorList norms2, double eps,
                    at::TensorList weights, at::IntArrayRef formats,
                    const c10::List<c10::optional<at::Tensor>>& qkv_biases, const at::Tensor& cos,
                    const at::Tensor& sin, Caches& caches, double scale, const at::Tensor& final_norm,
                    double final_eps, const at::Tensor& head, int64_t head_format,
                    const c10::optional<at::Tensor>& greedy, const c10::optional<at::Tensor>& logit_rows,
                    const LayerOptions& options) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "gqa::decode_model: x must be contiguous (B, E), got ", x.sizes());
  if (x.scalar_type() == at::kFloat)
    return decode_model_impl<float>(x, norms1, norms2, eps, weights, formats, qkv_biases, cos, sin, caches, scale,
                                    final_norm, final_eps, head, head_format, greedy, logit_rows, options);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gqa::decode_model: float32 or bfloat16 only, got ", x.scalar_type());
  return decode_model_impl<at::BFloat16>(x, norms1, norms2, eps, weights, formats, qkv_biases, cos, sin, caches,
                                         scale, final_norm, final_eps, head, head_format, greedy, logit_rows,
                                         options);
}

at::Tensor decode_model(const at::Tensor& x, at::TensorList norms1, at::TensorList norms2, double eps,
                        at::TensorList weights, at::IntArrayRef formats,
                        const c10::List<c10::optional<at::Tensor>>& qkv_biases, const at::Tensor& cos,
                        const at::Tensor& sin, at::TensorList key_caches, at::TensorList value_caches,
                        at::TensorList starts, at::TensorList cursors, double scale, const at::Tensor& final_norm,
                        double final_eps, const at::Tensor& head, int64_t head_format,
                        const c10::optional<at::Tensor>& greedy, c10::optional<at::TensorList> qk_norms,
                        double qk_eps, at::IntArrayRef windows, at::IntArrayRef rotates,
                        c10::optional<at::TensorList> post_norms, bool offset_norms, bool gelu,
                        at::ArrayRef<double> softcaps, const c10::optional<at::Tensor>& cos_local,
                        const c10::optional<at::Tensor>& sin_local, at::IntArrayRef kv_formats,
                        c10::optional<c10::string_view> reduce_group) {
  const size_t L = norms1.size();
  TORCH_CHECK(L >= 1 && norms2.size() == L && weights.size() == 7 * L && formats.size() == 7 * L &&
                  qkv_biases.size() == 3 * L && key_caches.size() == L && value_caches.size() == L &&
                  starts.size() == L && cursors.size() == L,
              "gqa::decode_model: per layer 2 norms, 7 weights and formats, 3 q/k/v biases, K and V caches, a start "
              "and a cursor; got ", L, " layers' norms1 and ", weights.size(), " weights");
  Caches caches{key_caches, value_caches, starts, cursors};
  set_kv_formats(caches, kv_formats);
  return dispatch(x, norms1, norms2, eps, weights, formats, qkv_biases, cos, sin, caches, scale, final_norm,
                  final_eps, head, head_format, greedy, c10::nullopt,
                  LayerOptions{qk_norms, qk_eps, windows, rotates, post_norms, offset_norms, gelu, softcaps, cos_local,
                               sin_local, reduce_group.has_value() ? std::string(*reduce_group) : std::string()});
}

// decode_model over paged caches: key_pools / value_pools [(blocks, H_kv, block_size, D)] per layer, block_table
// (B, max_blocks) int64 shared by the layers, positions (B,) int64: row b's new K/V go to its slot positions[b] and
// its attention reads slots [0, positions[b]]. Ragged rows, any batch size; a row's result does not depend on the
// other rows. Rows may share a sequence (its block table row repeated) at consecutive positions — a prompt chunk:
// every row's K/V are written before any row's attention reads them, so row b sees the rows before it (causal
// prefill in the same call as decode rows). logit_rows (N,) int64, when given: only those rows get logits (and
// greedy picks), in that order: the result is (N, V). reduce_group, when given, names a torch.distributed process
// group (a tensor-parallel rank's: its weights are the rank's shards, o_proj and down_proj give partial sums): each
// layer's two partial products are summed over the group by its all-reduce, inside the call, before they join the
// residual (two one-chunk phases a layer; the other threads wait), as the op-by-op sharded step adds them.
at::Tensor decode_paged(const at::Tensor& x, at::TensorList norms1, at::TensorList norms2, double eps,
                        at::TensorList weights, at::IntArrayRef formats,
                        const c10::List<c10::optional<at::Tensor>>& qkv_biases, const at::Tensor& cos,
                        const at::Tensor& sin, at::TensorList key_pools, at::TensorList value_pools,
                        const at::Tensor& block_table, const at::Tensor& positions, double scale,
                        const at::Tensor& final_norm, double final_eps, const at::Tensor& head, int64_t head_format,
                        const c10::optional<at::Tensor>& greedy, const c10::optional<at::Tensor>& logit_rows,
                        c10::optional<at::TensorList> qk_norms, double qk_eps, at::IntArrayRef windows,
                        at::IntArrayRef rotates, c10::optional<at::TensorList> post_norms, bool offset_norms,
                        bool gelu, at::ArrayRef<double> softcaps, const c10::optional<at::Tensor>& cos_local,
                        const c10::optional<at::Tensor>& sin_local, at::IntArrayRef kv_formats,
                        c10::optional<c10::string_view> reduce_group) {
  const size_t L = norms1.size();
  TORCH_CHECK(L >= 1 && norms2.size() == L && weights.size() == 7 * L && formats.size() == 7 * L &&
                  qkv_biases.size() == 3 * L && key_pools.size() == L && value_pools.size() == L,
              "gqa::decode_paged: per layer 2 norms, 7 weights and formats, 3 q/k/v biases, a K and a V pool; got ",
              L, " layers' norms1 and ", weights.size(), " weights");
  Caches caches{key_pools, value_pools, {}, {}, &block_table, &positions};
  set_kv_formats(caches, kv_formats);
  return dispatch(x, norms1, norms2, eps, weights, formats, qkv_biases, cos, sin, caches, scale, final_norm,
                  final_eps, head, head_format, greedy, logit_rows,
                  LayerOptions{qk_norms, qk_eps, windows, rotates, post_norms, offset_norms, gelu, softcaps, cos_local,
                               sin_local, reduce_group.has_value() ? std::string(*reduce_group) : std::string()});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gqa, m) {
  m.def(
      "decode_model(Tensor x, Tensor[] norms1, Tensor[] norms2, float eps, Tensor[] weights, int[] formats, "
      "Tensor?[] qkv_biases, Tensor cos, Tensor sin, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, "
      "Tensor[] starts, Tensor(c!)[] cursors, float scale, Tensor final_norm, float final_eps, Tensor head, "
      "int head_format, Tensor(d!)? greedy=None, Tensor[]? qk_norms=None, float qk_eps=1e-6, int[] windows=[], "
      "int[] rotates=[], Tensor[]? post_norms=None, bool offset_norms=False, bool gelu=False, float[] softcaps=[], "
      "Tensor? cos_local=None, Tensor? sin_local=None, int[] kv_formats=[], str? reduce_group=None) -> Tensor");
  m.def(
      "decode_paged(Tensor x, Tensor[] norms1, Tensor[] norms2, float eps, Tensor[] weights, int[] formats, "
      "Tensor?[] qkv_biases, Tensor cos, Tensor sin, Tensor(a!)[] key_pools, Tensor(b!)[] value_pools, "
      "Tensor block_table, Tensor positions, float scale, Tensor final_norm, float final_eps, Tensor head, "
      "int head_format, Tensor(d!)? greedy=None, Tensor? logit_rows=None, Tensor[]? qk_norms=None, "
      "float qk_eps=1e-6, int[] windows=[], int[] rotates=[], Tensor[]? post_norms=None, bool offset_norms=False, "
      "bool gelu=False, float[] softcaps=[], Tensor? cos_local=None, Tensor? sin_local=None, int[] kv_formats=[], "
      "str? reduce_group=None) -> Tensor");
  m.def("reduce_seconds() -> float", &reduce_seconds);  // no tensor arguments: one kernel for every backend
}

TORCH_LIBRARY_IMPL(gqa, CPU, m) {
  m.impl("decode_model", &decode_model);
  m.impl("decode_paged", &decode_paged);
}
