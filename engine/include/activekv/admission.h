#pragma once
/// @file admission.h
/// @brief Admission policy: which blocks enter a layer's active pool, and which leave it (the page table's storage
///        and its reset are kv_state.h's; which blocks a compressed-mode row asks for is selection.h's).
///
/// A unit (an exact-mode tile of a request row's context, or the union of a compressed decode row's selections) is
/// admitted whole: a resident block is a hit, a missing one takes a free slot (lowest index first) or evicts the least
/// recently used unpinned block (ties: lowest slot). The blocks of the units being computed are pinned until they are
/// released, so a pool of at least one tile can stream a context of any length.
#include <activekv/kv_state.h>

#include <cstdint>
#include <string>
#include <vector>

namespace activekv {

/// Admission modes.
enum class Mode : int { kExact = 0, kCompressed = 1 };

/// Mode from its option spelling ("exact" or "compressed"). @throws c10::ValueError naming the valid modes.
Mode parse_mode(const std::string& name);
/// Option spelling of a mode.
const char* mode_name(Mode mode);

/// What admitting one tile decided.
struct TileAdmission {
  std::vector<int64_t> slots;        ///< pool slot of each block of the tile, in tile order
  std::vector<int64_t> miss_blocks;  ///< blocks that must be copied host -> pool
  std::vector<int64_t> miss_slots;   ///< their destination slots (same order)
  int64_t hits = 0;
  int64_t evicted = 0;
};

/// Exact-mode tiles of a request row: the first `num_blocks` entries of its block-table row, `tile_blocks` at a time.
/// @param block_row pointer to num_blocks block ids
std::vector<std::vector<int64_t>> exact_tiles(const int32_t* block_row, int64_t num_blocks, int64_t tile_blocks);

/// Admit one tile's blocks into a layer's pool and pin them.
/// @param clock admission clock, advanced once per block touched (LRU order).
/// @throws c10::ValueError when the tile is larger than the pool minus the slots pinned already.
TileAdmission admit_tile(LayerState& layer, const std::vector<int64_t>& blocks, uint64_t& clock);
/// The same for n block ids at `blocks`.
TileAdmission admit_tile(LayerState& layer, const int64_t* blocks, int64_t n, uint64_t& clock);

/// Unpin the slots of a tile admitted by admit_tile.
void release_tile(LayerState& layer, const std::vector<int64_t>& slots);

/// Blocks read where they are resident, with no copy (the CUDA decode batch): if every one of `blocks` is resident,
/// touch them in order as admitting and releasing them unit by unit would (each a hit; the LRU clock and order
/// advance the same way) and return true; else change nothing and return false. Nothing may be pinned.
/// @param blocks ids in [0, host_blocks) (the plan's, checked against the host tier)
bool touch_resident(LayerState& layer, const std::vector<int64_t>& blocks, uint64_t& clock);

}  // namespace activekv
