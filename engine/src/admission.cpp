// Admission (admission.h): the exact-mode tiles of a row, admitting a unit's blocks into the pool (LRU eviction,
// pins) and releasing them.
#include <activekv/admission.h>
#include <activekv/check.h>

#include <algorithm>
#include <vector>

namespace activekv {

Mode parse_mode(const std::string& name) {
  if (name == "exact") return Mode::kExact;
  AKV_CHECK_VALUE(name == "compressed", "mode must be 'exact' or 'compressed', got '", name, "'");
  return Mode::kCompressed;
}

const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::kExact: return "exact";
    case Mode::kCompressed: return "compressed";
  }
  return "unknown";
}

std::vector<std::vector<int64_t>> exact_tiles(const int32_t* block_row, int64_t num_blocks, int64_t tile_blocks) {
  std::vector<std::vector<int64_t>> tiles;
  for (int64_t start = 0; start < num_blocks; start += tile_blocks) {
    const int64_t end = std::min(num_blocks, start + tile_blocks);
    tiles.emplace_back(block_row + start, block_row + end);
  }
  return tiles;
}

namespace {

void lru_unlink(LayerState& l, int64_t s) {
  const int64_t p = l.lru_prev[s], n = l.lru_next[s];
  (p >= 0 ? l.lru_next[p] : l.lru_head) = n;
  (n >= 0 ? l.lru_prev[n] : l.lru_tail) = p;
  l.lru_prev[s] = l.lru_next[s] = -1;
}

// Insert keeping the list ordered by last_use. The engine releases a tile's slots in admission order after every
// earlier release, so the walk from the tail stops at once; any other order stays correct, only slower.
void lru_insert(LayerState& l, int64_t s) {
  int64_t after = l.lru_tail;
  while (after >= 0 && l.last_use[after] > l.last_use[s]) after = l.lru_prev[after];
  const int64_t before = after >= 0 ? l.lru_next[after] : l.lru_head;
  l.lru_prev[s] = after;
  l.lru_next[s] = before;
  (after >= 0 ? l.lru_next[after] : l.lru_head) = s;
  (before >= 0 ? l.lru_prev[before] : l.lru_tail) = s;
}

}  // namespace

TileAdmission admit_tile(LayerState& layer, const std::vector<int64_t>& blocks, uint64_t& clock) {
  return admit_tile(layer, blocks.data(), static_cast<int64_t>(blocks.size()), clock);
}

TileAdmission admit_tile(LayerState& layer, const int64_t* blocks, int64_t n, uint64_t& clock) {
  TileAdmission out;
  out.slots.reserve(n);
  const int64_t pool = static_cast<int64_t>(layer.block_of_slot.size());
  // Validate before touching the page table, so a bad id leaves it as it was.
  for (int64_t i = 0; i < n; ++i)
    AKV_CHECK_INDEX(blocks[i] >= 0 && blocks[i] < layer.host_blocks, "block id must be in [0, ", layer.host_blocks,
                    "), got ", blocks[i]);
  AKV_CHECK_VALUE(n <= pool - layer.pinned_slots, "a tile of ", n, " blocks does not fit the active pool (", pool,
                  " slots, ", layer.pinned_slots, " pinned)");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = blocks[i];
    int64_t s = layer.slot_of_block[b];
    if (s >= 0) {
      ++out.hits;
      if (layer.pins[s] == 0) lru_unlink(layer, s);  // leaves the LRU order while pinned
    } else {
      if (layer.next_free < pool) {  // lowest free slot first
        s = layer.next_free++;
      } else {
        // Else the least recently used unpinned slot (last_use values are unique: no tie is left to break).
        AKV_CHECK_VALUE(layer.lru_head >= 0, "the active pool (", pool,
                        " blocks) has no unpinned slot left for a tile of ", n, " blocks");
        s = layer.lru_head;
        lru_unlink(layer, s);
        layer.slot_of_block[layer.block_of_slot[s]] = -1;
        note_page_change(layer, layer.block_of_slot[s]);
        ++out.evicted;
      }
      layer.block_of_slot[s] = b;
      layer.slot_of_block[b] = s;
      note_page_change(layer, b);
      out.miss_blocks.push_back(b);
      out.miss_slots.push_back(s);
    }
    if (layer.pins[s] == 0) ++layer.pinned_slots;
    layer.last_use[s] = ++clock;
    ++layer.pins[s];
    out.slots.push_back(s);
  }
  return out;
}

bool touch_resident(LayerState& layer, const std::vector<int64_t>& blocks, uint64_t& clock) {
  TORCH_INTERNAL_ASSERT(layer.pinned_slots == 0, "touch_resident with ", layer.pinned_slots, " pinned slots");
  for (const int64_t b : blocks)
    if (layer.slot_of_block[b] < 0) return false;
  // Unpinned and resident: each touch moves the slot to the newest end of the LRU list, as release_tile's insertion
  // of a slot with the newest last_use does.
  for (const int64_t b : blocks) {
    const int64_t s = layer.slot_of_block[b];
    lru_unlink(layer, s);
    layer.last_use[s] = ++clock;
    lru_insert(layer, s);
  }
  return true;
}

void release_tile(LayerState& layer, const std::vector<int64_t>& slots) {
  for (int64_t s : slots) {
    TORCH_INTERNAL_ASSERT(layer.pins[s] > 0, "releasing an unpinned pool slot ", s);
    if (--layer.pins[s] == 0) {
      --layer.pinned_slots;
      lru_insert(layer, s);
    }
  }
}

}  // namespace activekv
