// The CUDA path (forward_path.h): the ATen path's admission and row state, each unit computed by the CUDA kernel
// (cuda_kernel.h) reading the pool's slots in place, for the rows it takes (head size and rows = G * query tokens,
// cuda_kernel_supports); other rows fall back to the ATen path's tile ops.
#include <activekv/cuda_kernel.h>
#include <activekv/transfer.h>

#include "forward_path.h"

namespace activekv {

namespace {

class CudaPath : public AtenPath {
 public:
  using AtenPath::AtenPath;

 protected:
  bool supports(int64_t rows) const { return cuda_kernel_supports(g_.head_size, rows); }
  bool contiguous_query(int64_t rows) const override { return supports(rows); }

  // slots[h * n + j] is the pool slot of head h's j-th block, at row position pos[h * n + j].
  void kernel_tile(const LayerStep& s, size_t i, const std::vector<int64_t>& slots, const std::vector<int64_t>& pos,
                   int64_t n, int64_t first_query_pos, int64_t lq) {
    CudaAttendArgs a;
    a.pool = s.kv;
    a.slots = index_tensor(slots, device_);
    a.pos = index_tensor(pos, device_);
    a.n = n;
    a.first_query_pos = first_query_pos;
    a.num_q = lq;
    a.q = rows_[i].qg;
    a.m = rows_[i].st.m;
    a.l = rows_[i].st.l;
    a.acc = rows_[i].st.acc;
    a.scale = s.scale;
    cuda_attend()(a);
  }

  void attend_tile(const LayerStep& s, size_t i, int64_t tile, const std::vector<int64_t>& slots) override {
    if (!supports(rows_[i].qg.size(1))) return AtenPath::attend_tile(s, i, tile, slots);
    const auto& w = s.plan.rows[i];
    const int64_t kvh = g_.num_kv_heads, tb = g_.tile_blocks, n = static_cast<int64_t>(slots.size());
    std::vector<int64_t> head_slots(kvh * n), pos(kvh * n);
    for (int64_t hh = 0; hh < kvh; ++hh) {
      for (int64_t j = 0; j < n; ++j) {
        head_slots[hh * n + j] = slots[j];
        pos[hh * n + j] = tile * tb + j;
      }
    }
    kernel_tile(s, i, head_slots, pos, n, w.seq - w.lq, w.lq);
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
      std::vector<int64_t> slots(kvh * n), tpos(kvh * n);
      for (int64_t hh = 0; hh < kvh; ++hh) {
        for (int64_t j = 0; j < n; ++j) {
          slots[hh * n + j] = head_slots[hh * m + t + j];
          tpos[hh * n + j] = pp[hh * m + t + j];
        }
      }
      kernel_tile(s, i, slots, tpos, n, s.plan.rows[i].seq - 1, 1);
      telemetry_.add(Counter::kTilesComputed);
    }
  }
};

}  // namespace

std::unique_ptr<ForwardPath> make_cuda_path(const Geometry& g, const Selection& sel, at::Device device,
                                            Telemetry& telemetry) {
  return std::make_unique<CudaPath>(g, sel, device, telemetry);
}

}  // namespace activekv
