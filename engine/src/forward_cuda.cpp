// The CUDA path (forward_path.h): a step's exact decode rows in one launch of the decode batch kernel when the
// layer's blocks they read are all on the device (StepPlan::batch, planned here at build); every other unit through
// the ATen path's admission and row state, computed by the per-tile CUDA kernel (cuda_kernel.h) reading the pool's
// slots in place for the rows it takes (head size and rows = G * query tokens, cuda_kernel_supports), else by the
// ATen path's tile ops.
#include <activekv/cuda_kernel.h>
#include <activekv/transfer.h>

#include <algorithm>
#include <cstdint>

#include "env_int.h"
#include "forward_path.h"

namespace activekv {

namespace {

// ACTIVEKV_CUDA_SPLIT: 16-token sub-tiles per work item of the decode batch (1..64, rounded up to whole blocks), for
// measuring the split; unset or out of range: the plan's own choice.
int64_t split_override() { return env_int("ACTIVEKV_CUDA_SPLIT", 1, kCudaBatchMaxSplit, 0); }

class CudaPath : public AtenPath {
 public:
  CudaPath(const Geometry& g, const Selection& sel, at::Device device, Telemetry& telemetry)
      : AtenPath(g, sel, device, telemetry) {
    const auto& k = cuda_batch_kernel();
    if (k.attend != nullptr && cuda_batch_supports(g.dtype, g.head_size, g.group_size(), g.block_size))
      sms_ = k.multiprocessors(device.index());
  }

  // The decode batch: exact decode rows, split into work items of `split` sub-tiles so that the (item, KV head) grid
  // holds about 8 CTAs per multiprocessor (two waves of the four that fit) where the work allows, items of 32 to 64
  // sub-tiles (128 to 256 KiB of K and V per KV head at head size 128 in bfloat16); one int32 array to the device.
  void plan_batch(StepPlan& p) const override {
    if (sms_ == 0) return;
    DecodeBatch& b = p.batch;
    b.member.assign(p.rows.size(), 0);
    int64_t sub_tiles = 0;
    for (size_t i = 0; i < p.rows.size(); ++i) {
      const auto& w = p.rows[i];
      if (w.lq != 1 || w.selects) continue;
      b.rows.push_back(static_cast<int64_t>(i));
      b.member[i] = 1;
      b.blocks.insert(b.blocks.end(), p.blocks.begin() + w.first_block, p.blocks.begin() + w.first_block + w.nb);
      b.units += w.num_units;
      sub_tiles += (w.seq + 15) / 16;
    }
    if (b.rows.empty()) {
      b.member.clear();
      return;
    }
    const int64_t per_block = g_.block_size / 16;
    int64_t split = split_override();
    if (split == 0) split = std::clamp<int64_t>((sub_tiles * g_.num_kv_heads + 8 * sms_ - 1) / (8 * sms_), 32, 64);
    split = std::min(kCudaBatchMaxSplit, (split + per_block - 1) / per_block * per_block);
    b.split = split;
    for (const int64_t i : b.rows) b.items += ((p.rows[i].seq + 15) / 16 + split - 1) / split;
    const int64_t nrows = static_cast<int64_t>(b.rows.size());
    auto host = at::empty({4 * nrows + 8 * b.items + static_cast<int64_t>(b.blocks.size())},
                          at::TensorOptions().dtype(at::kInt).pinned_memory(true));
    int32_t* rows = host.data_ptr<int32_t>();
    int32_t* items = rows + 4 * nrows;
    int32_t* blocks = items + 8 * b.items;
    int64_t item = 0, block0 = 0;
    for (int64_t r = 0; r < nrows; ++r) {
      const auto& w = p.rows[b.rows[r]];
      const int64_t n_sub = (w.seq + 15) / 16;
      rows[4 * r] = static_cast<int32_t>(w.q0);
      rows[4 * r + 1] = static_cast<int32_t>(item);
      for (int64_t t0 = 0; t0 < n_sub; t0 += split, ++item) {
        int32_t* it = items + 8 * item;
        it[0] = static_cast<int32_t>(t0);
        it[1] = static_cast<int32_t>(std::min(n_sub, t0 + split));
        it[2] = static_cast<int32_t>(w.seq);
        it[3] = static_cast<int32_t>(w.q0);
        it[4] = static_cast<int32_t>(block0 + t0 / per_block);
        it[5] = it[6] = it[7] = 0;
      }
      rows[4 * r + 2] = static_cast<int32_t>(item);
      rows[4 * r + 3] = 0;
      block0 += w.nb;
    }
    std::copy(b.blocks.begin(), b.blocks.end(), blocks);
    b.arrays = host.to(device_, /*non_blocking=*/true);
  }

  Scoring scoring() const override { return Scoring::kBatched; }

  bool batch_fits(const LayerStep& s) const override {
    const auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
    const auto& q = s.query;
    return aligned(s.kv) && s.kv.is_contiguous() && aligned(q) && q.stride(2) == 1 && q.stride(0) % 8 == 0 &&
           q.stride(1) % 8 == 0;
  }

  void attend_batch(const LayerStep& s) override {
    const DecodeBatch& b = s.plan.batch;
    const int64_t group = g_.group_size(), need = b.items * g_.num_kv_heads * group * (g_.head_size + 2);
    if (!work_.defined() || work_.numel() < need)
      work_ = at::empty({need}, at::TensorOptions().dtype(at::kFloat).device(device_));
    CudaBatchArgs a;
    a.kv = s.kv;
    a.page = s.page;
    a.arrays = b.arrays;
    a.rows = static_cast<int64_t>(b.rows.size());
    a.items = b.items;
    a.blocks = static_cast<int64_t>(b.blocks.size());
    a.query = s.query;
    a.out = s.out;
    a.work = work_;
    a.group = group;
    a.scale = s.scale;
    cuda_batch_kernel().attend(a);
    telemetry_.add(Counter::kTilesComputed, b.units);
    telemetry_.add(Counter::kDecodeBatchRows, a.rows);
  }

 protected:
  bool supports(int64_t rows) const { return cuda_kernel_supports(g_.head_size, rows); }
  bool contiguous_query(int64_t rows) const override { return supports(rows); }

  // One index for the tile (one pinned buffer, one copy: per tile, host time is the streamed step's cost): idx[h * n
  // + j] is the pool slot of head h's j-th block, idx[kvh * n + h * n + j] its row position.
  void kernel_tile(const LayerStep& s, size_t i, const std::vector<int64_t>& idx, int64_t n, int64_t first_query_pos,
                   int64_t lq) {
    CudaAttendArgs a = row_args(s, i, n, first_query_pos, lq);
    const auto dev = index_tensor(idx, device_, s.upload);
    const auto half = static_cast<int64_t>(idx.size()) / 2;
    a.slots = dev.narrow(0, 0, half);
    a.pos = dev.narrow(0, half, half);
    cuda_attend()(a);
  }

  // The kernel's arguments for plan row i's tile of n blocks, but its index.
  CudaAttendArgs row_args(const LayerStep& s, size_t i, int64_t n, int64_t first_query_pos, int64_t lq) const {
    CudaAttendArgs a;
    a.pool = s.kv;
    a.n = n;
    a.first_query_pos = first_query_pos;
    a.num_q = lq;
    a.q = rows_[i].qg;
    a.m = rows_[i].st.m;
    a.l = rows_[i].st.l;
    a.acc = rows_[i].st.acc;
    a.scale = s.scale;
    return a;
  }

  void attend_tile(const LayerStep& s, size_t i, int64_t tile, const std::vector<int64_t>& slots) override {
    if (!supports(rows_[i].qg.size(1))) return AtenPath::attend_tile(s, i, tile, slots);
    const auto& w = s.plan.rows[i];
    const int64_t kvh = g_.num_kv_heads, tb = g_.tile_blocks, n = static_cast<int64_t>(slots.size());
    if (inline_ids_fit(slots.data(), n, inline_ids_limit())) {
      // Every head reads the same slots, at positions tile * tb + j: the slots in the launch's parameters, no upload.
      CudaAttendArgs a = row_args(s, i, n, w.seq - w.lq, w.lq);
      a.host_slots = slots.data();
      a.first_block = tile * tb;
      cuda_attend()(a);
      telemetry_.add(Counter::kTilesComputed);
      return;
    }
    std::vector<int64_t> idx(2 * kvh * n);
    for (int64_t hh = 0; hh < kvh; ++hh) {
      for (int64_t j = 0; j < n; ++j) {
        idx[hh * n + j] = slots[j];
        idx[(kvh + hh) * n + j] = tile * tb + j;
      }
    }
    kernel_tile(s, i, idx, n, w.seq - w.lq, w.lq);
    telemetry_.add(Counter::kTilesComputed);
  }

  void attend_selected(const LayerStep& s, size_t i, const std::vector<int64_t>& union_slots) override {
    if (!supports(rows_[i].qg.size(1))) return AtenPath::attend_selected(s, i, union_slots);
    const int64_t kvh = g_.num_kv_heads, tb = g_.tile_blocks, m = sel_.per_head();
    const RowSelection& rs = s.selections[i];
    const int64_t* pp = rs.pos_cpu.data_ptr<int64_t>();
    const auto head_slots = rs.head_slots(union_slots);
    // Tiles of tile_blocks per head, as the ATen path (the same tile count in telemetry).
    for (int64_t t = 0; t < m; t += tb) {
      const int64_t n = std::min(tb, m - t);
      std::vector<int64_t> idx(2 * kvh * n);
      for (int64_t hh = 0; hh < kvh; ++hh) {
        for (int64_t j = 0; j < n; ++j) {
          idx[hh * n + j] = head_slots[hh * m + t + j];
          idx[(kvh + hh) * n + j] = pp[hh * m + t + j];
        }
      }
      kernel_tile(s, i, idx, n, s.plan.rows[i].seq - 1, 1);
      telemetry_.add(Counter::kTilesComputed);
    }
  }

 private:
  int64_t sms_ = 0;  ///< multiprocessors of the device; 0: no decode batch (no kernel, or a shape it lacks)
  at::Tensor work_;  ///< the decode batch's float32 partials, grown as steps need
};

}  // namespace

std::unique_ptr<ForwardPath> make_cuda_path(const Geometry& g, const Selection& sel, at::Device device,
                                            Telemetry& telemetry) {
  return std::make_unique<CudaPath>(g, sel, device, telemetry);
}

}  // namespace activekv
