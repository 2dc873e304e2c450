#pragma once
/// @file attention.h
/// @brief Tiled attention: online softmax over tiles of blocks, GQA, causal prefill chunks and decode.
///
/// Online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the tiling of
/// FlashAttention, Dao et al. 2022): per query row keep the running max m, running sum l and a rescaled accumulator;
/// each tile computes s = (q k^T) * scale, masks, m' = max(m, rowmax(s)), p = exp(s - m'), alpha = exp(m - m'),
/// l = l * alpha + rowsum(p), acc = acc * alpha + p v. The output is acc / l. All math is float32 whatever the KV
/// dtype. This ATen composition is the path the Python reference mirrors op for op (parity is bit for bit).
///
/// GQA: query head h reads KV head h / group_size; the group's query rows are stacked so one matmul per KV head
/// serves the whole group: q is carried as [num_kv_heads, group_size * num_q_tokens, head_size].
#include <ATen/ATen.h>

#include <cstdint>

namespace activekv {

/// Running state of one request row's online softmax.
struct OnlineSoftmax {
  at::Tensor m;    ///< [num_kv_heads, rows, 1] float32 running max (-inf before the first key)
  at::Tensor l;    ///< [num_kv_heads, rows, 1] float32 running sum of exp
  at::Tensor acc;  ///< [num_kv_heads, rows, head_size] float32 rescaled accumulator
};

/// Query tokens of one request row, grouped per KV head.
/// @param q [num_q_tokens, num_heads, head_size] any float dtype
/// @return [num_kv_heads, group_size * num_q_tokens, head_size] float32 (row index g * num_q_tokens + i)
at::Tensor group_query(const at::Tensor& q, int64_t num_kv_heads);

/// Inverse of group_query for the output.
/// @param out [num_kv_heads, group_size * num_q_tokens, head_size] float32
/// @return [num_q_tokens, num_heads, head_size] float32
at::Tensor ungroup_output(const at::Tensor& out, int64_t num_q_tokens);

/// Causal mask of a tile for a request row: true where the key is masked out.
/// @param first_query_pos position of the row's first query token (seq_len - num_q_tokens)
/// @param key_start position of the tile's first key
/// @return [num_q_tokens, num_keys] bool: key_pos > query_pos. Query positions are < seq_len, so this also masks
///         the unwritten tail of the row's last block.
at::Tensor tile_mask(int64_t first_query_pos, int64_t num_q_tokens, int64_t key_start, int64_t num_keys,
                     at::Device device);

/// Fresh online-softmax state.
OnlineSoftmax online_softmax_init(int64_t num_kv_heads, int64_t rows, int64_t head_size, at::Device device);

/// Gather a tile's blocks from a block-layout tensor, head-major, in one pass (one index_select over a permuted view:
/// measured 6-10x faster here than a block gather followed by a permuting copy).
/// @param kv [num_blocks, num_kv_heads, 2, block_size, head_size] (the pool or a host tier)
/// @param slots [n] int64 block indices into kv, same device
/// @return [num_kv_heads, 2, n, block_size, head_size], contiguous
at::Tensor gather_tile(const at::Tensor& kv, const at::Tensor& slots);

/// Fold one tile into the state.
/// @param qg [num_kv_heads, group_size * num_q_tokens, head_size] float32 from group_query
/// @param tile [num_kv_heads, 2, num_tile_blocks, block_size, head_size], head-major (gather_tile, or a permuted
///        view of consecutive blocks)
/// @param mask bool, true = masked: [num_q_tokens, num_tile_blocks * block_size] from tile_mask (shared by every head),
///        or [num_kv_heads, 1, num_q_tokens, num_tile_blocks * block_size] (per-head selections)
/// @param scale softmax scale (usually head_size^-0.5)
/// Keys masked for every query row contribute nothing even when their slots hold NaN or inf (their V is taken as 0).
void online_softmax_tile(OnlineSoftmax& st, const at::Tensor& qg, const at::Tensor& tile, const at::Tensor& mask,
                         double scale);

/// acc / l. @return [num_kv_heads, rows, head_size] float32
at::Tensor online_softmax_finish(const OnlineSoftmax& st);

/// Tiled attention of one request row over a block-layout KV (no pool): the unit the engine composes.
/// @param q [num_q_tokens, num_heads, head_size]
/// @param kv [num_blocks, num_kv_heads, 2, block_size, head_size], the row's blocks in order
/// @param seq_len context length (num_q_tokens <= seq_len <= num_blocks * block_size)
/// @param tile_blocks blocks per tile (>= 1)
/// @return [num_q_tokens, num_heads, head_size] float32
/// @throws c10::ValueError on inconsistent shapes or devices; c10::TypeError on a non-floating-point q or kv.
at::Tensor tiled_attention(const at::Tensor& q, const at::Tensor& kv, int64_t seq_len, int64_t tile_blocks,
                           double scale);

}  // namespace activekv
