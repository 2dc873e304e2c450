// The ATen tile path (forward_path.h): one unit admitted and computed at a time, each tile gathered from the pool (in
// place: from the host tier) and folded into the row's online softmax with ATen ops (attention.h), the composition
// the Python reference mirrors op for op. Also the choice of an engine's path (make_forward_path).
#include <activekv/attention.h>
#include <activekv/cuda_kernel.h>
#include <activekv/transfer.h>

#include "forward_path.h"

namespace activekv {

std::unique_ptr<ForwardPath> make_forward_path(Kernel kernel, const Geometry& g, const Selection& sel,
                                               at::Device device, Telemetry& telemetry) {
  if (kernel == Kernel::kNative && device.is_cpu()) return make_cpu_path(g, sel, telemetry);
  if (kernel == Kernel::kNative && device.is_cuda() && cuda_attend() != nullptr)
    return make_cuda_path(g, sel, device, telemetry);
  return std::make_unique<AtenPath>(g, sel, device, telemetry);
}

void AtenPath::begin(const LayerStep& s) {
  rows_.clear();
  rows_.reserve(s.plan.rows.size());
  for (size_t i = 0; i < s.plan.rows.size(); ++i) {
    const auto& w = s.plan.rows[i];
    RowState& r = rows_.emplace_back();
    if (in_batch(s, i)) continue;  // attend_batch computes and writes it
    r.qg = group_query(s.query.narrow(0, w.q0, w.lq), g_.num_kv_heads);
    if (contiguous_query(r.qg.size(1))) r.qg = r.qg.contiguous();
    r.st = online_softmax_init(g_.num_kv_heads, r.qg.size(1), g_.head_size, device_);
  }
}

void AtenPath::attend(const LayerStep& s, const std::vector<AdmittedUnit>& round, int64_t /*heads_per_task*/) {
  for (const auto& a : round) {
    const auto i = static_cast<size_t>(s.plan.unit_row[a.unit]);
    if (s.plan.rows[i].selects) {
      attend_selected(s, i, a.slots);
    } else {
      attend_tile(s, i, a.unit - s.plan.rows[i].first_unit, a.slots);
    }
  }
}

void AtenPath::finish(const LayerStep& s) {
  for (size_t i = 0; i < rows_.size(); ++i) {
    if (in_batch(s, i)) continue;
    const auto& w = s.plan.rows[i];
    s.out.narrow(0, w.q0, w.lq).copy_(ungroup_output(online_softmax_finish(rows_[i].st), w.lq));
  }
}

void AtenPath::attend_tile(const LayerStep& s, size_t i, int64_t tile, const std::vector<int64_t>& slots) {
  const auto& w = s.plan.rows[i];
  const int64_t bs = g_.block_size, tb = g_.tile_blocks, n = static_cast<int64_t>(slots.size());
  auto gathered = gather_tile(s.kv, index_tensor(slots, device_, s.upload));  // [KVH, 2, n, bs, D]
  auto mask = tile_mask(w.seq - w.lq, w.lq, tile * tb * bs, n * bs, device_);
  online_softmax_tile(rows_[i].st, rows_[i].qg, gathered, mask, s.scale);
  telemetry_.add(Counter::kTilesComputed);
}

void AtenPath::attend_selected(const LayerStep& s, size_t i, const std::vector<int64_t>& union_slots) {
  const int64_t kvh = g_.num_kv_heads, bs = g_.block_size, tb = g_.tile_blocks, m = sel_.per_head();
  const int64_t seq = s.plan.rows[i].seq;
  const RowSelection& rs = s.selections[i];
  const auto head_slots = rs.head_slots(union_slots);
  // Each head gathers its own blocks: row h*m + j of [KVH * m, 2, bs, D] is (block pos[h, j], head h). The pool (or
  // in place the host tier) [P, KVH, 2, bs, D] viewed as [P * KVH, 2, bs, D] has K and V of one (block, head) in one contiguous row.
  std::vector<int64_t> flat(kvh * m);
  for (int64_t x = 0; x < kvh * m; ++x) flat[x] = head_slots[x] * kvh + x / m;
  const auto& pool = s.kv;
  auto per_head = pool.view({pool.size(0) * kvh, 2, bs, g_.head_size})
                      .index_select(0, index_tensor(flat, device_, s.upload))
                      .view({kvh, m, 2, bs, g_.head_size})
                      .permute({0, 2, 1, 3, 4});  // [KVH, 2, m, bs, D]
  auto offsets = at::arange(bs, at::TensorOptions().dtype(at::kLong).device(device_));
  for (int64_t t = 0; t < m; t += tb) {
    const int64_t n = std::min(tb, m - t);
    // Per-head causal mask of the decode token (position seq - 1): only the unwritten tail of the last block.
    auto kpos = rs.pos.narrow(1, t, n).unsqueeze(2).mul(bs).add(offsets).reshape({kvh, n * bs});
    auto mask = kpos.gt(seq - 1).view({kvh, 1, 1, n * bs});
    online_softmax_tile(rows_[i].st, rows_[i].qg, per_head.narrow(2, t, n), mask, s.scale);
    telemetry_.add(Counter::kTilesComputed);
  }
}

}  // namespace activekv
