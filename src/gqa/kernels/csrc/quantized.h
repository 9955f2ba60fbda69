// What cpu_kernels.cpp uses from quantized.cpp: the quantized multi-matrix GEMV (see quantized.cpp).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace gqa {

std::vector<at::Tensor> quantized_linear_rows(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef formats,
                                              const c10::List<c10::optional<at::Tensor>>& biases);

}  // namespace gqa
