// The CPU kernel's path (forward_path.h): a round of admitted units (every unit that fits the pool beside the others,
// StepPlan rounds) computed by one parallel region over its (request row, KV heads) tasks, each task's blocks attended
// in order by one thread with the kernel of cpu_kernel.h, reading the pool in place (with placement 'in_place', the
// host tier itself, and one round holds every unit). The rows' grouped queries and online-softmax state live in
// buffers of the path's own, and it writes every row's output itself.
//
// Rounds hold whole tiles, so a row's arithmetic does not depend on the rounds, the pool size or the thread count;
// a held unit's slots are the newest in LRU order and pins are released in admission order, so the slots, hits,
// evictions, LRU order and telemetry are those of one unit at a time (checked against the ATen path on the parity
// cells).
#include <activekv/check.h>
#include <activekv/cpu_kernel.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>

#include "../forward_path.h"

namespace activekv {

namespace {

// Query tokens of a prefill row per task (of every GQA group member, per KV head): a 2k-token chunk of a model of 3 KV
// heads makes 3 x 4 tasks instead of 3.
constexpr int64_t kRunTokens = 512;

// Segments of an exact decode row (one query token, two tiles or more): min(tiles, kDecodeSegments) runs of whole
// tiles, segment s from tile s * T / S, each with its online-softmax state of its own, merged in segment order when
// the layer finishes. A decode row of few KV heads then keeps every thread busy (3 KV heads on 2 threads would leave
// one idle a third of the step), and since the segments are fixed by the row's tile count alone, the row's
// arithmetic depends neither on the thread count nor on the rounds.
constexpr int64_t kDecodeSegments = 8;

// Query rows of the CPU kernel, grouped per KV head as group_query lays them out: of a request row whose grouped rows
// start at q, KV head hh, group member gi and token t is row hh * G * lq + gi * lq + t of q [rows, D] float32 (and of
// q_bf16, the bfloat16 query as given, where non-null). Rows [r0, r1) of the request row (its first query token q0):
// plain loops over the query's strides, no ATen op per row.
template <typename T>
void group_rows(const at::Tensor& query, int64_t q0, int64_t lq, int64_t d, int64_t r0, int64_t r1, float* q,
                at::BFloat16* q_bf16) {
  const T* src = query.data_ptr<T>();
  const int64_t s0 = query.stride(0), s1 = query.stride(1), s2 = query.stride(2);
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t head = row / lq, t = row % lq;  // head = hh * G + gi
    const T* x = src + (q0 + t) * s0 + head * s1;
    if (s2 == 1) {
      for (int64_t j = 0; j < d; ++j) q[row * d + j] = static_cast<float>(x[j]);
    } else {
      for (int64_t j = 0; j < d; ++j) q[row * d + j] = static_cast<float>(x[j * s2]);
    }
    if constexpr (std::is_same_v<T, at::BFloat16>)
      if (q_bf16 != nullptr)
        for (int64_t j = 0; j < d; ++j) q_bf16[row * d + j] = x[j * s2];
  }
}

// out[q0 + t, hh * G + gi, :] = acc / l of that grouped row (online_softmax_finish and ungroup_output of the ATen
// path: one float32 division per element, then the output dtype's rounding), for the request row's grouped rows
// [r0, r1). out: [tokens, heads, D] contiguous.
template <typename T>
void finish_rows(const float* acc, const float* l, int64_t q0, int64_t lq, int64_t heads, int64_t d, int64_t r0,
                 int64_t r1, const at::Tensor& out) {
  T* dst = out.data_ptr<T>();
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t head = row / lq, t = row % lq;
    T* o = dst + ((q0 + t) * heads + head) * d;
    for (int64_t j = 0; j < d; ++j) o[j] = static_cast<T>(acc[row * d + j] / l[row]);
  }
}

// Grouped rows of all request rows at once, [0, first.back()), split over the threads in ranges of at least
// kRowsPerThread rows (a decode step's few rows stay on the calling thread); fn(i, r0, r1) for request row i's rows
// [r0, r1) (numbered within the request row) of each range. Each row is written by one call: the result does not
// depend on the split.
constexpr int64_t kRowsPerThread = 256;
template <typename Fn>
void for_grouped_rows(const std::vector<int64_t>& first, const Fn& fn) {
  at::parallel_for(0, first.back(), kRowsPerThread, [&](int64_t begin, int64_t end) {
    auto i = static_cast<size_t>(std::upper_bound(first.begin(), first.end(), begin) - first.begin()) - 1;
    for (int64_t r = begin; r < end; ++i) {
      const int64_t stop = std::min(end, first[i + 1]);
      if (stop > r) fn(i, r - first[i], stop - first[i]);
      r = std::max(r, stop);
    }
  });
}

class CpuPath : public ForwardPath {
 public:
  CpuPath(const Geometry& g, const Selection& sel, Telemetry& telemetry) : g_(g), sel_(sel), telemetry_(telemetry) {}
  bool batches_units() const override { return true; }
  Scoring scoring() const override { return Scoring::kNative; }

  void begin(const LayerStep& s) override {
    const int64_t kvh = g_.num_kv_heads, d = g_.head_size, group = g_.num_heads / kvh;
    const auto& rows = s.plan.rows;
    // Every row's grouped query and online-softmax state (running max, sum, accumulator) in one buffer each: row i's
    // grouped rows start at first_[i] (kvh * G * lq of them).
    first_.assign(rows.size() + 1, 0);
    for (size_t i = 0; i < rows.size(); ++i) first_[i + 1] = first_[i] + kvh * group * rows[i].lq;
    const int64_t total = first_.back();
    AKV_CHECK_TYPE(g_.dtype == at::kFloat || g_.dtype == at::kBFloat16 || g_.dtype == at::kHalf,
                   "the CPU kernel supports float32, bfloat16 and float16, got ", g_.dtype);
    // Sized here, filled below by the threads (each grouped row's query and initial state where it is written).
    qbuf_.resize(total * d);
    mbuf_.resize(total);
    lbuf_.resize(total);
    accbuf_.resize(total * d);
    // Decode segments (kDecodeSegments): segment 0 uses the row's state above; segments 1.. their own, row i's from
    // part_first_[i] (segment s, KV head hh: part_first_[i] + ((s - 1) * kvh + hh) * G).
    segments_.assign(rows.size(), 1);
    part_first_.assign(rows.size() + 1, 0);
    for (size_t i = 0; i < rows.size(); ++i) {
      const PlannedRow& w = rows[i];
      if (!w.selects && w.lq == 1 && w.num_units >= 2) segments_[i] = std::min(w.num_units, kDecodeSegments);
      part_first_[i + 1] = part_first_[i] + (segments_[i] - 1) * kvh * group;
    }
    pmbuf_.assign(part_first_.back(), -std::numeric_limits<float>::infinity());
    plbuf_.assign(part_first_.back(), 0.f);
    paccbuf_.assign(part_first_.back() * d, 0.f);
    // The query rounded to bfloat16 (exactly the model's bfloat16 query) where the kernel reads it.
    qb16_.resize(g_.dtype == at::kBFloat16 && cpu_kernel_uses_bf16_query(d) ? total * d : 0);
    for_grouped_rows(first_, [&](size_t i, int64_t r0, int64_t r1) {
      const int64_t f = first_[i];
      std::fill(mbuf_.begin() + f + r0, mbuf_.begin() + f + r1, -std::numeric_limits<float>::infinity());
      std::fill(lbuf_.begin() + f + r0, lbuf_.begin() + f + r1, 0.f);
      std::fill(accbuf_.begin() + (f + r0) * d, accbuf_.begin() + (f + r1) * d, 0.f);
      float* q = qbuf_.data() + f * d;
      at::BFloat16* qb = qb16_.empty() ? nullptr : qb16_.data() + f * d;
      const int64_t q0 = rows[i].q0, lq = rows[i].lq;
      switch (g_.dtype) {
        case at::kFloat: group_rows<float>(s.query, q0, lq, d, r0, r1, q, qb); break;
        case at::kBFloat16: group_rows<at::BFloat16>(s.query, q0, lq, d, r0, r1, q, qb); break;
        default: group_rows<at::Half>(s.query, q0, lq, d, r0, r1, q, qb); break;
      }
    });
    round_.assign(rows.size(), {});
  }

  void attend(const LayerStep& s, const std::vector<AdmittedUnit>& round, int64_t per_task) override {
    const int64_t kvh = g_.num_kv_heads, d = g_.head_size, bs = g_.block_size, tb = g_.tile_blocks;
    const int64_t group = g_.num_heads / kvh;
    // The round's blocks of every row: pool slots and row positions of head hh at [hh * head_stride, + count).
    int64_t tiles = 0;
    for (const auto& a : round) {
      const auto i = static_cast<size_t>(s.plan.unit_row[a.unit]);
      const PlannedRow& w = s.plan.rows[i];
      RowRound& rr = round_[i];
      if (w.selects) {  // a compressed row's heads read m blocks each
        const RowSelection& sel = s.selections[i];
        const int64_t m = sel_.per_head();
        const int64_t* pp = sel.pos_cpu.data_ptr<int64_t>();
        rr.slots = sel.head_slots(a.slots);
        rr.pos.assign(pp, pp + kvh * m);
        rr.head_stride = m;
        tiles += (m + tb - 1) / tb;  // counted as the tiles of tile_blocks the other paths compute
      } else {  // every head of an exact row reads the same blocks
        const int64_t tile = a.unit - w.first_unit;
        rr.slots.insert(rr.slots.end(), a.slots.begin(), a.slots.end());
        for (size_t j = 0; j < a.slots.size(); ++j) rr.pos.push_back(tile * tb + static_cast<int64_t>(j));
        rr.head_stride = 0;
        ++tiles;
      }
    }
    // Tasks: (row, first KV head), per_task heads each. A task walks its heads tile by tile (a tile's slots hold every
    // head's K and V side by side: [P, KVH, 2, bs, D]), so the more heads per task, the closer the pool is read to its
    // address order. A row of more than kRunTokens query tokens (a prefill chunk) is split further, per KV head and run
    // of kRunTokens tokens (the run's tokens of every GQA group member in one call, which packs each chunk of K and V
    // once for them), so that a long prefill of few KV heads keeps every thread busy. A row's arithmetic does not
    // depend on how its query rows are grouped (cpu_kernel.h), and the runs are fixed by the row alone, so the output
    // is the same however many threads take the tasks. The threads claim tasks one at a time in list order; a run's
    // cost grows with its place in the chunk (causal: its tokens see more keys), so the runs are listed last run first:
    // the costliest are claimed first and the cheap ones fill in at the end.
    tasks_.clear();
    for (size_t i = 0; i < round_.size(); ++i) {
      if (round_[i].slots.empty()) continue;
      const int64_t lq = s.plan.rows[i].lq;
      if (lq > kRunTokens) {
        for (int64_t x = (lq + kRunTokens - 1) / kRunTokens - 1; x >= 0; --x)
          for (int64_t hh = 0; hh < kvh; ++hh)
            tasks_.push_back({i, hh, 1, x * kRunTokens, std::min(kRunTokens, lq - x * kRunTokens), 0, -1, 0, group});
      } else if (segments_[i] > 1) {
        // The round's tiles of the row (contiguous, tb slots each but the row's last), grouped by segment.
        const RowRound& rr = round_[i];
        const int64_t count = static_cast<int64_t>(rr.slots.size()), nseg = segments_[i];
        const int64_t tiles_of_row = s.plan.rows[i].num_units;
        // Segment of the tile holding slot j: the largest s with s * T / S <= tile.
        const auto segment_of = [&](int64_t j) { return ((rr.pos[j] / tb + 1) * nseg - 1) / tiles_of_row; };
        for (int64_t j0 = 0; j0 < count;) {
          const int64_t seg = segment_of(j0);
          int64_t j1 = j0 + tb;
          while (j1 < count && segment_of(j1) == seg) j1 += tb;
          j1 = std::min(j1, count);
          for (int64_t h0 = 0; h0 < kvh; h0 += per_task) tasks_.push_back({i, h0, per_task, 0, group, j0, j1, seg});
          j0 = j1;
        }
      } else {
        for (int64_t h0 = 0; h0 < kvh; h0 += per_task) tasks_.push_back({i, h0, per_task, 0, group * lq});
      }
    }
    const auto* pool_bytes = static_cast<const char*>(s.kv.data_ptr());  // the pool, or in place the host tier
    const int64_t run_bytes = 2 * bs * d * static_cast<int64_t>(s.kv.element_size());  // K and V of (block, head)
    const auto& rows = s.plan.rows;
    // Each thread claims the next task until none is left: tasks differ in cost (causal runs, rows of different
    // lengths), and a fixed split of the list would leave a thread waiting on the other's last tasks.
    const int64_t ntasks = static_cast<int64_t>(tasks_.size());
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min<int64_t>(ntasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      std::vector<const void*> ptrs;
      AttendArgs a;
      a.dtype = g_.dtype;
      a.block_size = bs;
      a.head_size = d;
      a.scale = s.scale;
      a.chunk_blocks = tb;
      for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < ntasks;
           t = next.fetch_add(1, std::memory_order_relaxed)) {
        const Task& task = tasks_[t];
        const size_t i = task.row;
        const RowRound& rr = round_[i];
        const int64_t h0 = task.h0, nrows = group * rows[i].lq, base = first_[i] + task.r0;
        const int64_t count = rr.head_stride > 0 ? rr.head_stride : static_cast<int64_t>(rr.slots.size());
        const bool run = task.rows < nrows;  // a run of tokens t0 .. of each group member, r0 = t0
        a.rows = task.rows;
        a.members = task.members;
        a.member_stride = rows[i].lq;
        a.num_q = run ? task.rows : rows[i].lq;
        a.first_query_pos = rows[i].seq - rows[i].lq + (run ? task.r0 : 0);
        // Exact rows: tile after tile, head after head (every head reads the same slots, whose K and V of all heads
        // lie side by side, so the pool is read close to its address order). Compressed rows: head after head, each
        // head's blocks in one call (the heads' blocks differ, so nothing is shared between them, and the kernel then
        // prefetches across tiles). Each (row, head) sees its blocks in order, in tiles of tb, either way.
        const int64_t step = rr.head_stride > 0 ? count : tb;
        const int64_t j_end = task.j1 >= 0 ? task.j1 : count;
        for (int64_t j = task.j0; j < j_end; j += step) {
          const int64_t n = std::min(step, j_end - j);
          for (int64_t hh = h0; hh < h0 + task.heads; ++hh) {
            const int64_t* slots = rr.slots.data() + hh * rr.head_stride + j;
            ptrs.resize(n);
            for (int64_t x = 0; x < n; ++x) ptrs[x] = pool_bytes + (slots[x] * kvh + hh) * run_bytes;
            a.q = qbuf_.data() + (base + hh * nrows) * d;
            a.q_bf16 = qb16_.empty() ? nullptr : qb16_.data() + (base + hh * nrows) * d;
            a.num_blocks = n;
            a.kv = ptrs.data();
            a.block_pos = rr.pos.data() + hh * rr.head_stride + j;
            if (task.seg == 0) {
              a.m = mbuf_.data() + base + hh * nrows;
              a.l = lbuf_.data() + base + hh * nrows;
              a.acc = accbuf_.data() + (base + hh * nrows) * d;
            } else {  // a later decode segment's own state (one query token: nrows = G)
              const int64_t p = part_first_[i] + ((task.seg - 1) * kvh + hh) * nrows;
              a.m = pmbuf_.data() + p;
              a.l = plbuf_.data() + p;
              a.acc = paccbuf_.data() + p * d;
            }
            attend_blocks_cpu(a);
          }
        }
      }
    });
    for (auto& rr : round_) {
      rr.slots.clear();
      rr.pos.clear();
    }
    telemetry_.add(Counter::kTilesComputed, tiles);
  }

  void finish(const LayerStep& s) override {
    const int64_t kvh = g_.num_kv_heads, d = g_.head_size, group = g_.num_heads / kvh;
    const auto& rows = s.plan.rows;
    merge_segments(kvh * group, d);
    for_grouped_rows(first_, [&](size_t i, int64_t r0, int64_t r1) {
      const float* acc = accbuf_.data() + first_[i] * d;
      const float* l = lbuf_.data() + first_[i];
      const int64_t q0 = rows[i].q0, lq = rows[i].lq, heads = kvh * group;
      switch (g_.dtype) {
        case at::kFloat: finish_rows<float>(acc, l, q0, lq, heads, d, r0, r1, s.out); break;
        case at::kBFloat16: finish_rows<at::BFloat16>(acc, l, q0, lq, heads, d, r0, r1, s.out); break;
        default: finish_rows<at::Half>(acc, l, q0, lq, heads, d, r0, r1, s.out); break;
      }
    });
  }

 private:
  // Each decode row's later segments merged into its first segment's state, in segment order (the online-softmax
  // merge of two states: the larger max, both sums and accumulators rescaled to it). `heads` = KV heads x G rows.
  void merge_segments(int64_t heads, int64_t d) {
    for (size_t i = 0; i < segments_.size(); ++i) {
      for (int64_t sgm = 1; sgm < segments_[i]; ++sgm) {
        for (int64_t r = 0; r < heads; ++r) {
          const int64_t p = part_first_[i] + (sgm - 1) * heads + r, q = first_[i] + r;
          const float ms = pmbuf_[p];
          if (ms == -std::numeric_limits<float>::infinity()) continue;  // no key seen: nothing to add
          const float m = std::max(mbuf_[q], ms);
          const float a0 = std::exp(mbuf_[q] - m), as = std::exp(ms - m);  // exp(-inf) = 0 for an empty first
          lbuf_[q] = lbuf_[q] * a0 + plbuf_[p] * as;
          float* acc = accbuf_.data() + q * d;
          const float* pacc = paccbuf_.data() + p * d;
          for (int64_t j = 0; j < d; ++j) acc[j] = acc[j] * a0 + pacc[j] * as;
          mbuf_[q] = m;
        }
      }
    }
  }

  // A row's blocks in the current round: pool slots and row positions of head hh at [hh * head_stride, + count).
  // Every head of an exact row reads the same blocks (head_stride 0); a compressed row's heads read m each.
  struct RowRound {
    std::vector<int64_t> slots, pos;
    int64_t head_stride = 0;
  };
  const Geometry& g_;
  const Selection& sel_;
  Telemetry& telemetry_;
  std::vector<int64_t> first_;
  std::vector<float> qbuf_, mbuf_, lbuf_, accbuf_;
  std::vector<int64_t> segments_, part_first_;  ///< decode segments per row; first row of its later segments' state
  std::vector<float> pmbuf_, plbuf_, paccbuf_;  ///< the later segments' online-softmax state
  std::vector<at::BFloat16> qb16_;
  std::vector<RowRound> round_;
  // A task: KV heads [h0, h0 + heads) of a request row, its grouped query rows [r0, r0 + rows) of each head (row
  // gi * lq + t of a head: group member gi, token t), and with members > 1 the same rows of the next members too
  // (rows r0 + g * lq ..: a prefill run); a decode segment's task the round's slots [j0, j1) of the row, into segment
  // seg's state (j1 = -1: every slot of the round, into the row's state).
  struct Task {
    size_t row;
    int64_t h0, heads, r0, rows, j0 = 0, j1 = -1, seg = 0, members = 1;
  };
  std::vector<Task> tasks_;
};

}  // namespace

std::unique_ptr<ForwardPath> make_cpu_path(const Geometry& g, const Selection& sel, Telemetry& telemetry) {
  return std::make_unique<CpuPath>(g, sel, telemetry);
}

}  // namespace activekv
