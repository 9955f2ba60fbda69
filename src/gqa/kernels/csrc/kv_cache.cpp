// gqa::quantize_kv: rows of a KV cache's new tokens into the blocks a quantized cache stores (kv_blocks.h).
//
//   gqa::quantize_kv(x (..., D) float32 / bfloat16 / float16, format 0 (q8_0) or 1 (q4_0), rotate) -> uint8 (...,
//                    D / 32 * block bytes); each row on its own, so a row's bytes do not depend on the rows beside it;
//                    rotate: the row rotated first (rotate_kv_row: how K rows are stored).

#include <ATen/Parallel.h>

#include "kv_blocks.h"

namespace {

using namespace gqa_cpu;

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t D, int64_t format, bool rotate, uint8_t* out) {
  const int64_t rb = kv_row_bytes(format, D);
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(D);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(x[r * D + d]);
      if (rotate) rotate_kv_row(row.data(), D);
      quantize_kv_row(row.data(), D, format, out + r * rb);
    }
  });
}

at::Tensor quantize_kv(const at::Tensor& x, int64_t format, bool rotate) {
  TORCH_CHECK(kv_format_known(format), "gqa::quantize_kv: format must be 0 (q8_0) or 1 (q4_0), got ", format);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) % KV_BLOCK == 0,
              "gqa::quantize_kv: the last dim must be a positive multiple of 32, got ", x.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t D = x.size(-1), rows = x.numel() / D;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = kv_row_bytes(format, D);
  at::Tensor out = at::empty(shape, x.options().dtype(at::kByte));
  uint8_t* o = out.mutable_data_ptr<uint8_t>();
  switch (x.scalar_type()) {
    case at::kFloat: quantize_rows(xc.const_data_ptr<float>(), rows, D, format, rotate, o); break;
    case at::kBFloat16: quantize_rows(xc.const_data_ptr<at::BFloat16>(), rows, D, format, rotate, o); break;
    case at::kHalf: quantize_rows(xc.const_data_ptr<at::Half>(), rows, D, format, rotate, o); break;
    default: TORCH_CHECK(false, "gqa::quantize_kv: float32, bfloat16 or float16 only, got ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gqa, m) { m.def("quantize_kv(Tensor x, int format, bool rotate=False) -> Tensor"); }

TORCH_LIBRARY_IMPL(gqa, CPU, m) { m.impl("quantize_kv", &quantize_kv); }
