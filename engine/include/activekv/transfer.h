#pragma once
/// @file transfer.h
/// @brief Host <-> device transfers: batched block copies between the host tier and the active pool.
///
/// One gather (`index_select`) and one scatter (`index_copy_`) per batch of blocks, whatever the block count, so the
/// cost is two ATen ops rather than one copy per block. On CPU these are plain memory copies. On CUDA tensors the
/// same ops run on the current stream; the dedicated copy stream with events belongs to the GPU path.
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace activekv {

/// A block-id list as an int64 tensor [n] on `device` (the index argument of every gather and scatter).
at::Tensor index_tensor(const std::vector<int64_t>& ids, at::Device device);

/// Copy blocks `src[src_ids[i]] -> dst[dst_ids[i]]` along dim 0.
/// @param src [num_src_blocks, ...] (e.g. the host tier [num_blocks, num_kv_heads, 2, block_size, head_size])
/// @param dst [num_dst_blocks, ...] same trailing shape and dtype (e.g. the pool)
/// @param src_ids, dst_ids equal-length block indices, in range for src and dst; dst_ids distinct
/// @return bytes copied
/// @throws c10::ValueError on mismatched shapes or lengths, a repeated dst id, a meta tensor or a dst that requires
///         grad; c10::TypeError on mismatched dtypes; c10::IndexError on an out-of-range id.
int64_t copy_blocks(const at::Tensor& src, const at::Tensor& dst, const std::vector<int64_t>& src_ids,
                    const std::vector<int64_t>& dst_ids);

}  // namespace activekv
