#pragma once
/// @file cuda_kernel.h
/// @brief CUDA decode attention kernel: split-K online softmax over pool blocks read in place, GQA-aware.
///
/// Flash-decoding structure (Dao et al., "Flash-Decoding for long-context inference", 2023; the online softmax of
/// Milakov & Gimelshein, 2018): the blocks of one tile are split across CTAs per KV head; each CTA keeps a running
/// (max, sum, accumulator) for the group's query rows over its blocks, read straight from the pool's slots (no
/// gather); a second kernel merges the splits into the engine's online-softmax state, so tiles compose exactly as
/// the ATen path's do. Float32 math for float32/bfloat16/float16 K/V. No atomics and a fixed split for a given tile,
/// so results are identical run to run; they are not bit-identical to the ATen tile path (different summation
/// order): docs/parity.md states the tolerance, tests/test_gpu.py checks it.
///
/// Compiled only when torch has CUDA and a CUDA compiler is found (CMake, ACTIVEKV_CUDA); the engine asks
/// cuda_attend() and falls back to the ATen tile path when it is null or the shape is unsupported.
#include <ATen/ATen.h>

#include <cstdint>

namespace activekv {

/// One request row's tile on a CUDA device.
struct CudaAttendArgs {
  at::Tensor pool;   ///< [pool_blocks, num_kv_heads, 2, block_size, head_size], contiguous, CUDA
  at::Tensor slots;  ///< int64 [num_kv_heads * n] on the device: pool slot of head h's j-th block at [h * n + j]
  at::Tensor pos;    ///< int64 [num_kv_heads * n] on the device: that block's position in the row
  int64_t n = 0;     ///< blocks per KV head in this tile
  int64_t first_query_pos = 0;  ///< position of query token 0 (causal limit: key pos <= first_query_pos + i)
  int64_t num_q = 0;            ///< query tokens of the row; rows = group_size * num_q (row = g * num_q + i)
  at::Tensor q;      ///< float32 [num_kv_heads, rows, head_size], contiguous
  at::Tensor m;      ///< float32 [num_kv_heads, rows, 1] running max (in/out, updated in place)
  at::Tensor l;      ///< float32 [num_kv_heads, rows, 1] running sum (in/out)
  at::Tensor acc;    ///< float32 [num_kv_heads, rows, head_size] rescaled accumulator (in/out)
  double scale = 1.0;
};

using CudaAttendFn = void (*)(const CudaAttendArgs&);

/// The kernel's largest rows (group_size * num_q) and its head sizes; other shapes use the ATen path.
constexpr int64_t kCudaMaxRows = 8;
inline bool cuda_kernel_supports(int64_t head_size, int64_t rows) {
  return (head_size == 64 || head_size == 128 || head_size == 256) && rows >= 1 && rows <= kCudaMaxRows;
}

/// The registered CUDA kernel, or nullptr in a build without CUDA.
CudaAttendFn cuda_attend();
/// Called once by the CUDA object's static initializer.
void register_cuda_attend(CudaAttendFn fn);

}  // namespace activekv
