// Compressed mode's selection (selection.h): the Quest bound (ATen ops, or the CPU kernel's scorer), the top-k per KV
// head, and each selecting row's selection of one layer with its union, record and counters.
#include <activekv/check.h>
#include <activekv/cpu_kernel.h>
#include <activekv/selection.h>
#include <activekv/transfer.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace activekv {


namespace {
// The Quest bound of float32 queries qf [..., KVH, G, D] against widened metadata kmin, kmax [..., KVH, D, C]: per
// KV head the largest of its query heads' bounds, [..., KVH, C]. sum_d max(q_d * min_d, q_d * max_d) =
// relu(q) . max + min(q, 0) . min  (max_d >= min_d).
at::Tensor quest_bound(const at::Tensor& qf, const at::Tensor& kmin, const at::Tensor& kmax) {
  return at::add(at::matmul(qf.clamp_min(0.0), kmax), at::matmul(qf.clamp_max(0.0), kmin)).amax(-2);
}

// The k highest of score [..., C] along its last dimension as a mask, ties by lowest position, NaN as +inf: every
// score above the k-th, then the lowest-positioned ones equal to it. Exactly k per row where a row holds k or more
// scores above -inf or has its -inf ones last (padding).
at::Tensor top_k_mask(const at::Tensor& score, int64_t k) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  auto s = at::nan_to_num(score, kInf, kInf, -kInf);
  auto kth = std::get<0>(at::topk(s, k, /*dim=*/-1, /*largest=*/true, /*sorted=*/true)).narrow(-1, k - 1, 1);
  auto above = s.gt(kth);
  auto tied = s.eq(kth);
  auto room = above.sum(-1, /*keepdim=*/true).neg().add(k);  // tied blocks still to take, lowest position first
  return above.logical_or(tied.logical_and(tied.cumsum(-1).le(room)));
}
}  // namespace

at::Tensor quest_scores(const at::Tensor& q, const at::Tensor& key_min, const at::Tensor& key_max,
                        const at::Tensor& ids) {
  const int64_t kvh = key_min.size(1), d = key_min.size(2), g = q.size(1) / kvh;
  auto kmin = key_min.index_select(0, ids).to(at::kFloat).permute({1, 2, 0});  // [KVH, D, C], widened exactly
  auto kmax = key_max.index_select(0, ids).to(at::kFloat).permute({1, 2, 0});  // [KVH, D, C]
  return quest_bound(q.to(at::kFloat).reshape({kvh, g, d}), kmin, kmax);       // [KVH, C]
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
  return top_k_mask(score, k).nonzero().select(1, 1).reshape({score.size(0), k});  // row-major: ascending per head
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

void check_selection(const Selection& sel) {
  AKV_CHECK_VALUE(sel.sink_blocks >= 0 && sel.sink_blocks <= kMaxSelectionCount,
                  "sink_blocks must be in [0, 2^40], got ", sel.sink_blocks);
  AKV_CHECK_VALUE(sel.recent_blocks >= 1 && sel.recent_blocks <= kMaxSelectionCount,
                  "recent_blocks must be in [1, 2^40] (the decode token's own block), got ", sel.recent_blocks);
  AKV_CHECK_VALUE(sel.top_k >= 1 && sel.top_k <= kMaxSelectionCount, "top_k must be in [1, 2^40], got ", sel.top_k);
}

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

namespace {
// A batch of a layer's selecting rows at once, on the query's device (select_rows with Scoring::kBatched): the Quest
// bound of the rows' candidates, padded to the longest row's count, in two batched matmuls; the top k per (row, KV
// head) as top_blocks takes them, padding ranked below every candidate (each row has more than k); the chosen positions
// read with a stable sort instead of nonzero, so no op waits for the device. [rows, KVH, m] int64 positions.
at::Tensor select_batch(const StepPlan& plan, const std::vector<size_t>& selecting, const LayerState& layer,
                        const at::Tensor& query, const Selection& sel) {
  const int64_t r = static_cast<int64_t>(selecting.size()), kvh = layer.key_min.size(1), d = layer.key_min.size(2);
  const int64_t g = query.size(1) / kvh, k = sel.top_k, sink = sel.sink_blocks, rec = sel.recent_blocks;
  int64_t cmax = 0;
  for (size_t i : selecting) {
    const int64_t cand = plan.rows[i].nb - sink - rec;
    AKV_CHECK_VALUE(cand > k, "a selecting row needs more than sink + recent + k = ", sel.per_head(), " blocks, got ",
                    plan.rows[i].nb);
    cmax = std::max(cmax, cand);
  }
  // One index array to the device: candidate block ids [r, cmax] (padding repeats the row's first candidate), the
  // candidate count of each row [r], its query token [r] and its recent positions [r, rec].
  std::vector<int64_t> host(r * (cmax + 2 + rec));
  int64_t *ids = host.data(), *count = ids + r * cmax, *token = count + r, *recent = token + r;
  for (int64_t j = 0; j < r; ++j) {
    const PlannedRow& w = plan.rows[selecting[j]];
    const int64_t cand = w.nb - sink - rec;
    const int64_t* row = plan.blocks.data() + w.first_block + sink;
    for (int64_t c = 0; c < cmax; ++c) ids[j * cmax + c] = row[c < cand ? c : 0];
    count[j] = cand;
    token[j] = w.q0;
    for (int64_t t = 0; t < rec; ++t) recent[j * rec + t] = w.nb - rec + t;
  }
  const auto dev = index_tensor(host, query.device());
  const auto cand_ids = dev.narrow(0, 0, r * cmax);
  const auto meta = [&](const at::Tensor& m) {  // [r, KVH, D, cmax], widened exactly
    return m.index_select(0, cand_ids).to(at::kFloat).view({r, cmax, kvh, d}).permute({0, 2, 3, 1});
  };
  const auto qf = query.index_select(0, dev.narrow(0, r * cmax + r, r)).to(at::kFloat).reshape({r, kvh, g, d});
  const auto bound = quest_bound(qf, meta(layer.key_min), meta(layer.key_max));  // [r, KVH, cmax]
  const auto opts = at::TensorOptions().dtype(at::kLong).device(query.device());
  // Padding as NaN would rank first; as -inf it ranks after every candidate (a NaN bound becomes +inf first).
  const auto padding = at::arange(cmax, opts).view({1, 1, cmax}).ge(dev.narrow(0, r * cmax, r).view({r, 1, 1}));
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const auto chosen = top_k_mask(at::nan_to_num(bound, kInf, kInf, -kInf).masked_fill(padding, -kInf), k);
  const auto top = std::get<1>(at::sort(chosen.logical_not().to(at::kByte), /*stable=*/true, /*dim=*/-1,
                                        /*descending=*/false))
                       .narrow(-1, 0, k);  // the chosen positions, ascending
  const auto sinks = at::arange(0, sink, opts).view({1, 1, sink}).expand({r, kvh, sink});
  const auto recents = dev.narrow(0, r * (cmax + 2), r * rec).view({r, 1, rec}).expand({r, kvh, rec});
  return at::cat({sinks, top.add(sink), recents}, -1);
}

// Widened key metadata of one batch of rows, at most (the rows' [KVH, D, candidates] in float32 for key_min, as many
// for key_max, and the matmuls' operands beside them): a batch 16 at 128k with block 16 would otherwise hold ~1 GB.
constexpr int64_t kSelectBatchBytes = int64_t{128} << 20;

// select_batch over the selecting rows in batches of at most kSelectBatchBytes of widened metadata each.
at::Tensor select_batched(const StepPlan& plan, const std::vector<size_t>& selecting, const LayerState& layer,
                          const at::Tensor& query, const Selection& sel) {
  RECORD_FUNCTION("activekv::select_batched", std::vector<c10::IValue>());
  int64_t cmax = 0;
  for (size_t i : selecting) cmax = std::max(cmax, plan.rows[i].nb - sel.sink_blocks - sel.recent_blocks);
  const int64_t row_bytes = std::max<int64_t>(cmax, 1) * layer.key_min.size(1) * layer.key_min.size(2) * 4;
  const auto per_batch = static_cast<size_t>(std::max<int64_t>(kSelectBatchBytes / row_bytes, 1));
  if (selecting.size() <= per_batch) return select_batch(plan, selecting, layer, query, sel);
  std::vector<at::Tensor> parts;
  for (size_t b = 0; b < selecting.size(); b += per_batch) {
    const std::vector<size_t> rows(selecting.begin() + static_cast<std::ptrdiff_t>(b),
                                   selecting.begin() + static_cast<std::ptrdiff_t>(std::min(b + per_batch,
                                                                                            selecting.size())));
    parts.push_back(select_batch(plan, rows, layer, query, sel));
  }
  return at::cat(parts, 0);
}
}  // namespace

std::vector<int64_t> RowSelection::head_slots(const std::vector<int64_t>& union_slots) const {
  const int64_t n = pos_cpu.numel();
  const int64_t* pp = pos_cpu.data_ptr<int64_t>();
  std::vector<int64_t> out(n);
  for (int64_t i = 0; i < n; ++i)
    out[i] = union_slots[std::lower_bound(union_pos.begin(), union_pos.end(), pp[i]) - union_pos.begin()];
  return out;
}

namespace {
// select_rows' scoring row by row: [KVH, m] positions per row, on the query's device, into out[i].pos. With
// native_scores and at least two selecting rows per thread, one parallel region scores the rows (a row per task).
void select_each(const StepPlan& plan, const std::vector<size_t>& selecting, const LayerState& layer,
                 const at::Tensor& query, const Selection& sel, bool native_scores, std::vector<RowSelection>& out) {
  const auto choose = [&](size_t i) {
    const PlannedRow& w = plan.rows[selecting[i]];
    const auto& ids = w.row_blocks_dev.defined() ? w.row_blocks_dev : w.row_blocks;
    out[selecting[i]].pos =
        select_blocks(query.narrow(0, w.q0, w.lq), layer.key_min, layer.key_max, ids, sel, native_scores);
  };
  const int64_t n = static_cast<int64_t>(selecting.size());
  if (native_scores && n >= 2 * at::get_num_threads()) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) choose(static_cast<size_t>(i));
    });
  } else {
    for (size_t i = 0; i < selecting.size(); ++i) choose(i);
  }
}
}  // namespace

std::vector<RowSelection> select_rows(const StepPlan& plan, LayerState& layer, const at::Tensor& query,
                                      const Selection& sel, Scoring scoring, Telemetry& telemetry) {
  std::vector<RowSelection> out(plan.rows.size());
  std::vector<size_t> selecting;
  for (size_t i = 0; i < plan.rows.size(); ++i)
    if (plan.rows[i].selects) selecting.push_back(i);
  // Score and choose (reads the layer's key metadata only). Off the CPU, every row's positions come to the host in
  // one copy: one wait for the device per layer, not per row.
  const int64_t kvh = layer.key_min.size(1), m = sel.per_head();
  at::Tensor all_pos;  // [rows, KVH, m] on the host
  if (scoring == Scoring::kBatched && !selecting.empty() && !query.is_cpu()) {
    const auto all = select_batched(plan, selecting, layer, query, sel);
    for (size_t j = 0; j < selecting.size(); ++j) out[selecting[j]].pos = all[static_cast<int64_t>(j)];
    all_pos = all.to(at::kCPU);
  } else {
    select_each(plan, selecting, layer, query, sel, scoring == Scoring::kNative, out);
    if (!selecting.empty() && !query.is_cpu()) {
      std::vector<at::Tensor> rows_pos;
      rows_pos.reserve(selecting.size());
      for (size_t i : selecting) rows_pos.push_back(out[i].pos);
      all_pos = at::stack(rows_pos).to(at::kCPU);
    }
  }
  // Record, in row order: the union of the heads' blocks (admitted, all pinned while the row attends), the layer's
  // last selection and the counters.
  for (size_t j = 0; j < selecting.size(); ++j) {
    const size_t i = selecting[j];
    const PlannedRow& w = plan.rows[i];
    RowSelection& s = out[i];
    s.pos_cpu = all_pos.defined() ? all_pos[static_cast<int64_t>(j)] : s.pos.to(at::kCPU).contiguous();
    const int64_t* pp = s.pos_cpu.data_ptr<int64_t>();
    s.union_pos.assign(pp, pp + kvh * m);
    std::sort(s.union_pos.begin(), s.union_pos.end());
    s.union_pos.erase(std::unique(s.union_pos.begin(), s.union_pos.end()), s.union_pos.end());
    const int64_t* row = plan.blocks.data() + w.first_block;
    for (int64_t p : s.union_pos) s.union_blocks.push_back(row[p]);
    layer.last_selection.emplace_back(w.req, w.row_blocks.index_select(0, s.pos_cpu.view({-1})).view({kvh, m}));
    telemetry.add(Counter::kCompressedRows);
    telemetry.add(Counter::kCompressedContextBlocks, w.nb);
    telemetry.add(Counter::kSelectedBlocks, kvh * m);
    telemetry.add(Counter::kUnionBlocks, static_cast<int64_t>(s.union_blocks.size()));
  }
  return out;
}

}  // namespace activekv
