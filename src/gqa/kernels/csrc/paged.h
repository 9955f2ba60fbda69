// A paged KV cache as the kernels read it (gqa::paged_attention, gqa::decode_paged): per layer one pool of blocks
// (blocks, H_kv, block_size, D); a batch row's block table lists the blocks its slots are in, in order.
#pragma once
#include <ATen/ATen.h>

namespace gqa_cpu {

// block_table (B, M) int64 and lengths (B,) int64, contiguous; each row's length at most M * block_size, and the
// blocks that hold its first `lengths[b]` slots in [0, blocks): a wrong table is an error, never a read out of the
// pool.
inline void check_block_table(const at::Tensor& block_table, const at::Tensor& lengths, int64_t B, int64_t blocks,
                              int64_t block_size, const char* op) {
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.is_contiguous() &&
                  block_table.size(0) == B,
              op, ": block_table must be a contiguous int64 (B, max_blocks) tensor with B = ", B, ", got ",
              block_table.sizes(), " ", block_table.scalar_type());
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.dim() == 1 && lengths.is_contiguous() &&
                  lengths.size(0) == B,
              op, ": lengths must be a contiguous int64 (B,) tensor with B = ", B, ", got ", lengths.sizes(), " ",
              lengths.scalar_type());
  TORCH_CHECK(block_size >= 1, op, ": block_size must be positive");
  const int64_t M = block_table.size(1);
  const int64_t* table = block_table.const_data_ptr<int64_t>();
  const int64_t* len = lengths.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] >= 0 && len[b] <= M * block_size, op, ": row ", b, "'s length ", len[b],
                " does not fit its ", M, " blocks of ", block_size, " slots");
    for (int64_t i = 0; i < (len[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(table[b * M + i] >= 0 && table[b * M + i] < blocks, op, ": row ", b, " block ", i, " is ",
                  table[b * M + i], ", not in [0, ", blocks, ")");
  }
}

}  // namespace gqa_cpu
