#pragma once
/// @file kv_state.h
/// @brief Key-value state: the host tier (vLLM's per-layer KV cache, referenced), the active pool (engine-owned),
///        the page table keyed by vLLM's physical block id (its storage and its reset; the policy that fills it and
///        evicts from it is admission.h's), per-block key metadata, and the KV update that writes them.
///
/// Coherence rule: every KV update writes the host tier and writes through to the pool copy of a resident block, so
/// a block that vLLM frees and reuses for another request is never read stale from the pool.
#include <activekv/geometry.h>
#include <activekv/telemetry.h>

#include <cstdint>
#include <vector>

namespace activekv {

/// State of one layer.
struct LayerState {
  at::Tensor pool;      ///< [pool_blocks, num_kv_heads, 2, block_size, head_size], geometry dtype
  /// [host_blocks, num_kv_heads, head_size] in the geometry (KV) dtype, per-dimension key minimum of the block (+inf
  /// before its first key): the min of keys stored in that dtype is one of them, so the metadata is exact and takes
  /// half the bytes of float32 for bfloat16 / float16 KV. Undefined where the state keeps no key metadata (an exact
  /// engine never reads it) and before the layer's host tier is bound.
  at::Tensor key_min;
  at::Tensor key_max;   ///< same shape and dtype: per-dimension key maximum of the block (-inf before its first key)
  /// The bound host tier [host_blocks, num_kv_heads, 2, block_size, head_size], a view of vLLM's tensor. Holding it
  /// keeps its storage alive, so a new KV cache can never reuse the address and pass for the bound one.
  at::Tensor host;
  int64_t host_blocks = 0;  ///< blocks in the bound host tier
  std::vector<int64_t> slot_of_block;  ///< [host_blocks] pool slot holding the block, -1 if not resident
  std::vector<int64_t> block_of_slot;  ///< [pool_blocks] block held by the slot, -1 if free
  std::vector<uint64_t> last_use;      ///< [pool_blocks] admission clock at the slot's last use (LRU)
  std::vector<int32_t> pins;           ///< [pool_blocks] >0 while the current tile uses the slot
  // Indexes over the vectors above, kept in step by admission.h (admit_tile, release_tile) and reset_page_table, so
  // admitting a block costs O(1) instead of a scan of the pool:
  int64_t next_free = 0;          ///< slots [next_free, pool_blocks) are free (a slot is freed only by a reset)
  int64_t pinned_slots = 0;       ///< slots with pins > 0
  std::vector<int64_t> lru_prev;  ///< [pool_blocks] doubly linked list of occupied unpinned slots, by last_use
  std::vector<int64_t> lru_next;  ///< [pool_blocks] (-1 ends it)
  int64_t lru_head = -1;          ///< least recently used unpinned slot, -1 if none
  int64_t lru_tail = -1;          ///< most recently used unpinned slot
  /// Compressed mode, last forward: (request row, [num_kv_heads, per_head] int64 block ids each head attended).
  std::vector<std::pair<int64_t, at::Tensor>> last_selection;
  /// slot_of_block as int32 on the pool's device, for kernels that find a block's slot there (the CUDA decode
  /// batch); brought up to date by KVState::device_page, from the blocks whose slot changed since (page_changed), or
  /// whole when page_stale (a reset, or more changes than are worth listing).
  at::Tensor page_dev;
  std::vector<int64_t> page_changed;
  bool page_stale = true;
};

/// Record that block b's slot changed (admission.h keeps the page table; KVState::device_page reads this).
inline void note_page_change(LayerState& layer, int64_t b) {
  if (layer.page_stale) return;
  if (static_cast<int64_t>(layer.page_changed.size()) >= layer.host_blocks / 8 + 64) {
    layer.page_stale = true;  // a whole copy is as cheap, and the list stops growing
    layer.page_changed.clear();
    return;
  }
  layer.page_changed.push_back(b);
}

/// Empty a layer's page table: every pool slot free, nothing resident or pinned, LRU clock entries 0. Sizes come from
/// block_of_slot (pool) and slot_of_block (host blocks), which must be sized already.
void reset_page_table(LayerState& layer);

/// A step's slot mapping on a CUDA device, its entries checked on the host once (Engine::build, where the step's
/// metadata is copied to the host already), so that each layer's KV update of the step reads it on the device only.
/// An update trusts it only for the same tensor unchanged (covers); any other slot mapping is checked as before.
struct CheckedSlots {
  at::Tensor tensor;            ///< the checked tensor, held (its memory cannot pass for another tensor's)
  int64_t version = -1;         ///< its version counter when checked; -1 for an inference tensor (no counter)
  std::vector<int64_t> values;  ///< its entries: each -1 (padding) or >= 0, no slot twice
  /// Whether `slot_mapping` is the checked tensor or a prefix view of it, unchanged by any ATen op since the check:
  /// same memory, dtype, device and stride, no more entries, same version counter.
  bool covers(const at::Tensor& slot_mapping) const;
};

/// Check a step's slot mapping (copied to the host once). @return the record, or an empty one (covers nothing) when the
/// tensor is not a 1-D int32/int64 CUDA tensor, or an entry is below -1 or repeats: the KV update then checks it
/// itself and raises its own error.
CheckedSlots check_step_slots(const at::Tensor& slot_mapping);

/// The two tiers of every layer.
class KVState {
 public:
  /// @param pool_blocks active-pool slots per layer (>= 0; 0 for an engine that attends in place, which has no pool).
  /// @param device device of the pool (the host tier's device on CPU).
  /// @param key_metadata keep per-block key min/max (what compressed selection reads): 1/block_size of the KV cache's
  ///        bytes, allocated when a layer's host tier is bound and maintained by every write. Without it, key_min /
  ///        key_max stay undefined and writes touch only the host tier and the pool.
  KVState(const Geometry& g, int64_t pool_blocks, at::Device device, bool key_metadata);

  const Geometry& geometry() const { return g_; }
  int64_t pool_blocks() const { return pool_blocks_; }
  bool key_metadata() const { return key_metadata_; }
  /// Bytes of key metadata held, summed over layers (0 without key_metadata).
  int64_t key_metadata_bytes() const;
  LayerState& layer(int64_t index);
  const LayerState& layer(int64_t index) const;

  /// Validate a per-layer KV cache and view it in ActiveKV's layout [num_blocks, num_kv_heads, 2, block_size,
  /// head_size]. Changes nothing.
  /// @throws c10::TypeError / c10::ValueError for a kv_cache of the wrong dtype, device, shape or contiguity.
  at::Tensor host_view(const at::Tensor& kv_cache) const;

  /// Bind a layer's host tier (a view from host_view). A different tensor than the bound one (vLLM reallocated its KV
  /// cache) resets the layer's page table and key metadata, counted as kHostRebinds; the key metadata's bytes go to
  /// the kKeyMetadataBytes gauge.
  /// @throws c10::ValueError (before anything changes) if the memory overlaps another layer's bound host tier.
  void bind_host(int64_t layer, const at::Tensor& host, Telemetry& t);
  /// The checks of bind_host alone, for callers that validate everything before changing anything. Changes nothing.
  /// O(1) when `host` is the view bound already (its overlaps were checked when it was bound, and every layer bound
  /// since checked itself against it); O(layers) otherwise.
  void check_bindable(int64_t layer, const at::Tensor& host) const;

  /// Write new K/V at their slots: host tier, write-through to resident pool copies, per-block key min/max where the
  /// state keeps them (reset when a block's offset 0 is written, since vLLM fills a fresh block from offset 0).
  /// Validates everything first, then binds `host` and writes: on bad input nothing changes.
  /// @param host [num_blocks, num_kv_heads, 2, block_size, head_size] from host_view
  /// @param key, value [num_tokens, num_kv_heads, head_size], geometry dtype, same device
  /// @param slot_mapping [n] int64 with n <= num_tokens: slot of token i, or -1 (PAD_SLOT_ID) to skip
  ///
  /// On a CUDA device with the CUDA kernel built, the write is two launches on the current stream (cuda_kernel.h
  /// CudaKvWriteArgs) that read the slots on the device: nothing synchronises with the host, and a pinned host tier
  /// holds the tokens only once the stream has run them (a host reader synchronises first). The slots are checked on
  /// the host before anything is written: from `checked` when it covers slot_mapping (no copy), else by copying
  /// slot_mapping to the host.
  /// @param checked the step's checked slot mapping (Engine::build), or null
  /// @throws c10::IndexError for a slot outside [-1, num_blocks * block_size); c10::ValueError / c10::TypeError for
  ///         a key, value or slot_mapping of the wrong dtype, shape or device, a repeated slot, a meta tensor, or a
  ///         kv_cache, key or value that requires grad.
  void write(int64_t layer, const at::Tensor& host, const at::Tensor& key, const at::Tensor& value,
             const at::Tensor& slot_mapping, Telemetry& t, const CheckedSlots* checked = nullptr);

  /// Whether a CUDA KV update since the last call found a slot outside the KV cache on the device (it wrote nothing
  /// for that token); clears the flag. Only a slot mapping changed after its check gets there. Read after a host
  /// synchronisation with the stream (Engine::build's copies of the step metadata).
  bool take_write_error();

  /// Forget every resident block of a layer (the pool's bytes stay; nothing reads a free slot).
  void reset_layer(int64_t layer);

  /// The layer's page table on the pool's device: int32 [host_blocks], block id -> pool slot or -1, brought up to date
  /// on the current stream (the changed entries, or the whole table) through pinned memory with non-blocking copies.
  const at::Tensor& device_page(int64_t layer);

 private:
  Geometry g_;
  int64_t pool_blocks_;
  at::Device device_;
  bool key_metadata_;
  std::vector<LayerState> layers_;
  at::Tensor write_error_;  ///< int32 [1] in pinned host memory mapped into the device: the CUDA write's error flag
};

}  // namespace activekv
