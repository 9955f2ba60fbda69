// What the other kernel files use from quantized.cpp: the quantized GEMV over several matrices, and its parts for
// callers that schedule the rows themselves (the one-call decode step). Formats: 0 = q8_0, 1 = q4_0, 2 = q4_1,
// 3 = q5_0, 4 = q5_1, 5 = q4_k, 6 = q5_k, 7 = q6_k.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace gqa {

// Storage aligned to 64-byte cache lines: a lane group's 64-byte loads (row_lanes.h) then never straddle two lines
// (malloc aligns to 16 bytes: a 16-row product of a 1536 x 576 Q4_1 matrix took 85 or 108 us from run to run as
// the addresses fell; aligned, 77-83 us).
template <class T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <class U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <class T>
using LineVector = std::vector<T, LineAligned<T>>;

std::vector<at::Tensor> quantized_linear_rows(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef formats,
                                              const c10::List<c10::optional<at::Tensor>>& biases);

// x (N, K) quantized per 32-value block: q (N, K) int8, d (N, K / 32) scales, ds (N, K / 32) = d * sum of the q.
// A block with a NaN, an infinity or a value beyond 2^64 in magnitude is all zeros here (q, d, ds) and listed in
// nonfinite (n * nb + b, ascending): its products are taken in float.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> ds;  // d * (sum of the block's q): the block's sum of x, as the kernel sees it
  std::vector<int64_t> nonfinite;
  std::vector<float> dt, dst;  // d and ds of the first n4 = N / 4 * 4 rows (0 when in lanes), block-major: (K / 32, n4)
  int64_t n4 = 0;
  // The rows in SIMD lanes, for row_lanes.h's kernels (AVX-512 VNNI builds, N >= 4; else empty): groups of `lanes`
  // rows (16, or 8 for the last <= 8), the missing rows of a group zero. Group g's block b holds, at
  // lq[g.q_at + b * 32 * lanes], eight runs of lanes x 4 bytes (run j: q[4j .. 4j + 3] of each row), and at
  // g.s_at + b * lanes its rows' d (ld), ds (lds) and the integer sums of their q (lsum; lsum_lo: of the first 16).
  struct LaneGroup {
    int64_t n0, rows, lanes, q_at, s_at;
    int64_t twice = -1;  // an 8-lane group: its rows twice in 16 lanes at twice[this] (lanes r and 8 + r: row r)
  };
  std::vector<int32_t> sum, sum_lo;  // (N, K / 32) with the lanes: the integer sums of each block's q, of its first 16
  std::vector<LaneGroup> groups;
  std::vector<LaneGroup> twice;  // for kernels taking two weight rows at once (row_lanes.h's lanes_pair_dot)
  LineVector<int8_t> lq;
  LineVector<float> ld, lds;
  LineVector<int32_t> lsum, lsum_lo;
};

// Bytes of one weight row of K values in `format` (K a multiple of its block: 32, or 256 for the K formats).
int64_t quantized_row_bytes(int64_t format, int64_t K);

// x (N, K), K a multiple of 32, quantized for quantized_rows_dot.
QuantizedRows quantize_input(const float* x, int64_t N, int64_t K);
QuantizedRows quantize_input(const at::BFloat16* x, int64_t N, int64_t K);

// buf (N, rows) = x @ dequant(w)^T for `rows` weight rows of `format` at w (xr = quantize_input(x)); a row's sum does
// not depend on which slice of rows computes it.
void quantized_rows_dot(const uint8_t* w, int64_t format, int64_t rows, int64_t K, const QuantizedRows& xr,
                        const float* x, int64_t N, float* buf);
void quantized_rows_dot(const uint8_t* w, int64_t format, int64_t rows, int64_t K, const QuantizedRows& xr,
                        const at::BFloat16* x, int64_t N, float* buf);

}  // namespace gqa
