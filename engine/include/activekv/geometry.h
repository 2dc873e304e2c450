#pragma once
/// @file geometry.h
/// @brief Context geometry: the shape of the model's KV and ActiveKV's frozen KV-cache layout.
///
/// KV-cache layout (frozen; every other part, the reference and the vLLM backend use it):
///
///     // [num_blocks, num_kv_heads, 2, block_size, head_size]   (2: 0 = K, 1 = V)
///
/// K and V of one block and one KV head are one contiguous run of 2 * block_size * head_size elements, so a tile
/// kernel reads a (block, KV head) pair with one stream. It is a pure reinterpretation of vLLM's LBHNC per-layer view
/// `[num_blocks, num_kv_heads, block_size, 2 * head_size]` (same bytes per block and per head), which is what the
/// ActiveKV backend declares to vLLM; vLLM's own CPU_ATTN reads the same bytes as `[.., 2 * block_size, head_size]`.
/// A token at slot s lives in block s / block_size at offset s % block_size.
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace activekv {

/// Geometry of one model's attention KV, validated at construction.
struct Geometry {
  int64_t num_layers = 0;    ///< attention layers the engine serves
  int64_t num_heads = 0;     ///< query heads per layer
  int64_t num_kv_heads = 0;  ///< KV heads per layer; num_heads % num_kv_heads == 0 (GQA group = ratio)
  int64_t head_size = 0;     ///< elements per head vector
  int64_t block_size = 0;    ///< tokens per block
  at::ScalarType dtype = at::kFloat;  ///< KV dtype: float32, bfloat16 or float16
  int64_t tile_blocks = 1;   ///< blocks per attention tile

  /// @throws c10::ValueError on a non-positive size or a head count that is not a multiple of the KV head count;
  ///         c10::TypeError on an unsupported dtype.
  Geometry(int64_t num_layers, int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size,
           at::ScalarType dtype, int64_t tile_blocks);
  Geometry() = default;

  /// Query heads per KV head (the GQA group size).
  int64_t group_size() const { return num_heads / num_kv_heads; }
  /// (block, offset) of a slot. @throws c10::IndexError for a negative slot.
  std::pair<int64_t, int64_t> slot_to_block(int64_t slot) const;
  /// Blocks that hold `length` tokens: ceil(length / block_size). @throws c10::ValueError for length < 0.
  int64_t blocks_for(int64_t length) const;
  /// Elements of one block (K and V, all KV heads).
  int64_t elements_per_block() const { return num_kv_heads * 2 * block_size * head_size; }
  /// Bytes of one block (K and V, all KV heads), the unit every transfer moves.
  int64_t bytes_per_block() const;
  /// Shape of a per-layer KV cache with `num_blocks` blocks: [num_blocks, num_kv_heads, 2, block_size, head_size].
  std::vector<int64_t> kv_cache_shape(int64_t num_blocks) const;
  /// The shape vLLM's LBHNC per-layer view has: [num_blocks, num_kv_heads, block_size, 2 * head_size].
  std::vector<int64_t> vllm_cache_shape(int64_t num_blocks) const;
  /// Tile size in tokens.
  int64_t tile_tokens() const { return tile_blocks * block_size; }
};

/// KV dtypes the engine accepts.
std::vector<at::ScalarType> supported_dtypes();
/// Head sizes the engine accepts (any positive size works on the ATen path; this is the list the vLLM backend
/// declares, matching vLLM's CPU backend).
std::vector<int64_t> supported_head_sizes();
/// Block sizes the vLLM backend declares.
std::vector<int64_t> supported_block_sizes();

/// View a per-layer KV-cache tensor in ActiveKV's layout.
/// @param kv_cache contiguous, dtype == geometry.dtype, either [num_blocks, num_kv_heads, 2, block_size, head_size]
///                 or vLLM's [num_blocks, num_kv_heads, block_size, 2 * head_size].
/// @param name argument name used in error messages.
/// @return a view [num_blocks, num_kv_heads, 2, block_size, head_size] of the same storage.
/// @throws c10::TypeError on dtype, c10::ValueError on shape or contiguity.
at::Tensor as_block_layout(const Geometry& g, const at::Tensor& kv_cache, const char* name);

/// Human-readable shape, e.g. "[4, 2, 16]", for error messages.
std::string shape_str(at::IntArrayRef sizes);

/// CPU pools of `pool_blocks` blocks per layer (pool_blocks x bytes_per_block x num_layers) against this machine's
/// physical memory; `label` names pool_blocks in the message (the option's spelling where options gave it). Nothing
/// for a device pool or no pool. Checked before the pools are allocated (KVState, Engine, the options).
/// @throws c10::ValueError when they would not fit (allocating them would end in the kernel's OOM killer).
void check_pools_fit_memory(const Geometry& g, int64_t pool_blocks, at::Device device, const std::string& label);

}  // namespace activekv
