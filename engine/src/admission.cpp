#include <activekv/admission.h>
#include <activekv/check.h>
#include <activekv/cpu_kernel.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
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
  TileAdmission out;
  out.slots.reserve(blocks.size());
  const int64_t pool = static_cast<int64_t>(layer.block_of_slot.size());
  // Validate before touching the page table, so a bad id leaves it as it was.
  for (int64_t b : blocks)
    AKV_CHECK_INDEX(b >= 0 && b < layer.host_blocks, "block id must be in [0, ", layer.host_blocks, "), got ", b);
  AKV_CHECK_VALUE(static_cast<int64_t>(blocks.size()) <= pool - layer.pinned_slots, "a tile of ", blocks.size(),
                  " blocks does not fit the active pool (", pool, " slots, ", layer.pinned_slots, " pinned)");
  for (int64_t b : blocks) {
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
                        " blocks) has no unpinned slot left for a tile of ", blocks.size(), " blocks");
        s = layer.lru_head;
        lru_unlink(layer, s);
        layer.slot_of_block[layer.block_of_slot[s]] = -1;
        ++out.evicted;
      }
      layer.block_of_slot[s] = b;
      layer.slot_of_block[b] = s;
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

void release_tile(LayerState& layer, const std::vector<int64_t>& slots) {
  for (int64_t s : slots) {
    TORCH_INTERNAL_ASSERT(layer.pins[s] > 0, "releasing an unpinned pool slot ", s);
    if (--layer.pins[s] == 0) {
      --layer.pinned_slots;
      lru_insert(layer, s);
    }
  }
}

void reset_page_table(LayerState& layer) {
  const auto pool = static_cast<int64_t>(layer.block_of_slot.size());
  std::fill(layer.slot_of_block.begin(), layer.slot_of_block.end(), -1);
  std::fill(layer.block_of_slot.begin(), layer.block_of_slot.end(), -1);
  layer.last_use.assign(pool, 0);
  layer.pins.assign(pool, 0);
  layer.lru_prev.assign(pool, -1);
  layer.lru_next.assign(pool, -1);
  layer.lru_head = layer.lru_tail = -1;
  layer.next_free = 0;
  layer.pinned_slots = 0;
}

}  // namespace activekv

namespace activekv {

at::Tensor quest_scores(const at::Tensor& q, const at::Tensor& key_min, const at::Tensor& key_max,
                        const at::Tensor& ids) {
  const int64_t kvh = key_min.size(1), d = key_min.size(2), g = q.size(1) / kvh;
  auto kmin = key_min.index_select(0, ids).to(at::kFloat).permute({1, 2, 0});  // [KVH, D, C], widened exactly
  auto kmax = key_max.index_select(0, ids).to(at::kFloat).permute({1, 2, 0});  // [KVH, D, C]
  auto qf = q.to(at::kFloat).reshape({kvh, g, d});                // [KVH, G, D]
  // sum_d max(q_d * min_d, q_d * max_d) = relu(q) . max + min(q, 0) . min  (max_d >= min_d)
  auto bound = at::add(at::matmul(qf.clamp_min(0.0), kmax), at::matmul(qf.clamp_max(0.0), kmin));  // [KVH, G, C]
  return bound.amax(1);                                                                             // [KVH, C]
}

at::Tensor quest_scores_native(const at::Tensor& q, const at::Tensor& key_min, const at::Tensor& key_max,
                               const at::Tensor& ids) {
  RECORD_FUNCTION("activekv::quest_scores_native", std::vector<c10::IValue>());  // named in torch.profiler tables
  const int64_t kvh = key_min.size(1), d = key_min.size(2), g = q.size(1) / kvh, c = ids.size(0);
  const auto dt = key_min.scalar_type();
  TORCH_INTERNAL_ASSERT(key_min.is_cpu() && key_min.is_contiguous() && key_max.is_contiguous() &&
                        key_max.scalar_type() == dt &&
                        (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf));
  auto qf = q.to(at::kFloat).reshape({kvh * g, d});
  auto q_pos = qf.clamp_min(0.0).contiguous(), q_neg = qf.clamp_max(0.0).contiguous();
  auto blocks = ids.to(at::kLong).contiguous();
  auto score = at::empty({kvh, c}, q.options().dtype(at::kFloat));
  QuestArgs a;
  a.num_kv_heads = kvh;
  a.group = g;
  a.head_size = d;
  a.q_pos = q_pos.data_ptr<float>();
  a.q_neg = q_neg.data_ptr<float>();
  a.dtype = dt;
  a.key_min = key_min.const_data_ptr();
  a.key_max = key_max.const_data_ptr();
  a.blocks = blocks.data_ptr<int64_t>();
  a.num_blocks = c;
  a.score = score.data_ptr<float>();
  // Each block's score is computed by one thread in a fixed order: the same for any thread count.
  at::parallel_for(0, c, 64, [&](int64_t begin, int64_t end) { quest_scores_cpu(a, begin, end); });
  return score;
}

at::Tensor top_blocks(const at::Tensor& score, int64_t k) {
  // NaN scores (from non-finite key metadata) rank first, as +inf, so exactly k blocks are chosen per head.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  auto s = at::nan_to_num(score, kInf, kInf, -kInf);
  auto kth = std::get<0>(at::topk(s, k, /*dim=*/1, /*largest=*/true, /*sorted=*/true)).narrow(1, k - 1, 1);
  auto above = s.gt(kth);
  auto tied = s.eq(kth);
  auto room = above.sum(1, /*keepdim=*/true).neg().add(k);  // tied blocks still to take, lowest position first
  auto chosen = above.logical_or(tied.logical_and(tied.cumsum(1).le(room)));
  return chosen.nonzero().select(1, 1).reshape({score.size(0), k});  // row-major: ascending per head
}

namespace {
// select_blocks' result from the native scores [KVH, C] (CPU float32, contiguous), without ATen ops: per head the
// candidates ordered by (score descending, NaN as +inf; position ascending) and the first k taken (std::nth_element,
// then sorted by position), which is top_blocks' set: every score above the k-th, then the lowest positions equal to
// it. Then sinks, chosen + sink, recents.
at::Tensor select_native(const at::Tensor& score, int64_t nb, const Selection& sel) {
  const int64_t kvh = score.size(0), c = score.size(1), k = sel.top_k, m = sel.per_head();
  auto out = at::empty({kvh, m}, at::TensorOptions().dtype(at::kLong));
  const float* s = score.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  std::vector<std::pair<float, int64_t>> order(c);  // (score with NaN as +inf, candidate position)
  std::vector<int64_t> top(k);
  for (int64_t h = 0; h < kvh; ++h) {
    const float* sh = s + h * c;
    for (int64_t i = 0; i < c; ++i) order[i] = {std::isnan(sh[i]) ? std::numeric_limits<float>::infinity() : sh[i], i};
    std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);  // -0 and +0 tie, as at::eq has them
    });
    for (int64_t j = 0; j < k; ++j) top[j] = order[j].second;
    std::sort(top.begin(), top.end());
    int64_t* oh = o + h * m;
    for (int64_t j = 0; j < sel.sink_blocks; ++j) *oh++ = j;
    for (int64_t j = 0; j < k; ++j) *oh++ = top[j] + sel.sink_blocks;
    for (int64_t j = nb - sel.recent_blocks; j < nb; ++j) *oh++ = j;
  }
  return out;
}
}  // namespace

at::Tensor select_blocks(const at::Tensor& q, const at::Tensor& key_min, const at::Tensor& key_max,
                         const at::Tensor& row_blocks, const Selection& sel, bool native_scores) {
  RECORD_FUNCTION("activekv::select_blocks", std::vector<c10::IValue>());
  const int64_t nb = row_blocks.size(0), kvh = key_min.size(1);
  const int64_t cand = nb - sel.sink_blocks - sel.recent_blocks;
  AKV_CHECK_VALUE(cand > sel.top_k, "a selecting row needs more than sink + recent + k = ", sel.per_head(),
                  " blocks, got ", nb);
  auto ids = row_blocks.narrow(0, sel.sink_blocks, cand);
  if (native_scores) return select_native(quest_scores_native(q, key_min, key_max, ids), nb, sel);
  auto score = quest_scores(q, key_min, key_max, ids);
  auto top = top_blocks(score, sel.top_k);
  auto opts = at::TensorOptions().dtype(at::kLong).device(q.device());
  auto sinks = at::arange(0, sel.sink_blocks, opts).expand({kvh, sel.sink_blocks});
  auto recents = at::arange(nb - sel.recent_blocks, nb, opts).expand({kvh, sel.recent_blocks});
  return at::cat({sinks, top.add(sel.sink_blocks), recents}, 1);
}

}  // namespace activekv
