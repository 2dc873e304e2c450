// The step plan (step_plan.h): vLLM's step metadata checked, and the layer-independent work of a step planned, once.
#include <activekv/check.h>
#include <activekv/step_plan.h>
#include <activekv/transfer.h>

#include <algorithm>
#include <limits>

namespace activekv {

namespace {

bool is_index_dtype(at::ScalarType t) { return t == at::kInt || t == at::kLong; }

void check_index_tensor(const at::Tensor& t, const char* name, int64_t dim) {
  AKV_CHECK_TYPE(t.defined(), name, " must be a tensor, got None");
  AKV_CHECK_TYPE(is_index_dtype(t.scalar_type()), name, " must be int32 or int64, got ", t.scalar_type());
  AKV_CHECK_VALUE(t.dim() == dim, name, " must be ", dim, "-D, got ", shape_str(t.sizes()));
  check_has_data(t, name);
}

// The plan is kept as int32 (vLLM's own dtype): an int64 value outside int32 is an error, never a silent wrap.
void check_int32_range(const at::Tensor& t, const char* name) {
  if (t.scalar_type() != at::kLong || t.numel() == 0) return;
  const auto lo = t.min().item<int64_t>(), hi = t.max().item<int64_t>();
  AKV_CHECK_VALUE(lo >= std::numeric_limits<int32_t>::min() && hi <= std::numeric_limits<int32_t>::max(), name,
                  " values must fit in int32, got the range [", lo, ", ", hi, "]");
}

}  // namespace

StepPlan plan_step(const Geometry& g, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                   const at::Tensor& block_table, int64_t num_reqs, int64_t num_actual_tokens,
                   int64_t per_head_blocks, at::Device device, Telemetry& telemetry) {
  check_index_tensor(query_start_loc, "query_start_loc", 1);
  check_index_tensor(seq_lens, "seq_lens", 1);
  check_index_tensor(block_table, "block_table", 2);
  AKV_CHECK_VALUE(num_reqs >= 0, "num_reqs must be >= 0, got ", num_reqs);
  AKV_CHECK_VALUE(num_actual_tokens >= 0, "num_actual_tokens must be >= 0, got ", num_actual_tokens);
  // Compared as size - 1 >= num_reqs: num_reqs + 1 overflows for num_reqs = INT64_MAX (undefined behaviour).
  AKV_CHECK_VALUE(query_start_loc.size(0) - 1 >= num_reqs, "query_start_loc must have >= num_reqs + 1 entries (",
                  "num_reqs = ", num_reqs, "), got ", query_start_loc.size(0));
  AKV_CHECK_VALUE(seq_lens.size(0) >= num_reqs, "seq_lens must have >= num_reqs = ", num_reqs, " entries, got ",
                  seq_lens.size(0));
  AKV_CHECK_VALUE(block_table.size(0) >= num_reqs, "block_table must have >= num_reqs = ", num_reqs,
                  " rows, got ", block_table.size(0));
  check_int32_range(query_start_loc, "query_start_loc");
  check_int32_range(seq_lens, "seq_lens");
  check_int32_range(block_table, "block_table");
  StepPlan p;
  p.query_start_loc = query_start_loc.narrow(0, 0, num_reqs + 1).to(at::kCPU, at::kInt).contiguous().clone();
  p.seq_lens = seq_lens.narrow(0, 0, num_reqs).to(at::kCPU, at::kInt).contiguous().clone();
  p.block_table = block_table.narrow(0, 0, num_reqs).to(at::kCPU, at::kInt).contiguous().clone();
  p.num_reqs = num_reqs;
  p.num_actual_tokens = num_actual_tokens;
  const int32_t* qsl = p.query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = p.seq_lens.data_ptr<int32_t>();
  const int64_t width = p.block_table.size(1);
  AKV_CHECK_VALUE(qsl[0] == 0, "query_start_loc[0] must be 0, got ", qsl[0]);
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t lq = static_cast<int64_t>(qsl[r + 1]) - qsl[r];  // in 64 bits: int32 ends never wrap
    AKV_CHECK_VALUE(lq >= 0, "query_start_loc must be non-decreasing, got ", qsl[r], " then ", qsl[r + 1],
                    " at row ", r);
    AKV_CHECK_VALUE(sl[r] >= lq, "seq_lens[", r, "] (", sl[r], ") must be >= the row's query tokens (", lq, ")");
    AKV_CHECK_VALUE(g.blocks_for(sl[r]) <= width, "seq_lens[", r, "] = ", sl[r], " needs ", g.blocks_for(sl[r]),
                    " blocks but block_table has ", width, " columns");
    // Block ids of the columns the row uses: never negative (their upper bound, the KV cache's block count, is
    // checked by each forward against its cache: check_plan_blocks).
    const int32_t* row = p.block_table.data_ptr<int32_t>() + r * width;
    if (lq == 0) continue;
    for (int64_t j = 0, nb = g.blocks_for(sl[r]); j < nb; ++j)
      AKV_CHECK_INDEX(row[j] >= 0, "block_table[", r, ", ", j, "] must be a block id >= 0, got ", row[j]);
  }
  AKV_CHECK_VALUE(qsl[num_reqs] <= num_actual_tokens, "query_start_loc[num_reqs] (", qsl[num_reqs],
                  ") must be <= num_actual_tokens (", num_actual_tokens, ")");

  // Every check passed: the rows, their block ids and admission units.
  const int32_t* bt = p.block_table.data_ptr<int32_t>();
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t lq = static_cast<int64_t>(qsl[r + 1]) - qsl[r];
    if (lq == 0) continue;
    PlannedRow& w = p.rows.emplace_back();
    w.req = r;
    w.q0 = qsl[r];
    w.lq = lq;
    w.seq = sl[r];
    w.nb = g.blocks_for(w.seq);
    w.first_block = static_cast<int64_t>(p.blocks.size());
    w.first_unit = p.num_units();
    const int32_t* row = bt + r * width;
    p.blocks.insert(p.blocks.end(), row, row + w.nb);
    for (int64_t j = 0; j < w.nb; ++j) p.max_block = std::max<int64_t>(p.max_block, row[j]);
    w.selects = per_head_blocks > 0 && lq == 1 && w.nb > per_head_blocks;
    if (w.selects) {
      const std::vector<int64_t> ids(p.blocks.end() - w.nb, p.blocks.end());
      w.row_blocks = index_tensor(ids, at::kCPU);
      if (!device.is_cpu()) w.row_blocks_dev = index_tensor(ids, device);
      w.num_units = 1;
      p.selecting = true;
    } else {
      w.num_units = (w.nb + g.tile_blocks - 1) / g.tile_blocks;
      p.exact_tiles += w.num_units;
    }
    p.unit_row.insert(p.unit_row.end(), w.num_units, static_cast<int64_t>(p.rows.size()) - 1);
  }
  telemetry.add(Counter::kPlannedBlocks, static_cast<int64_t>(p.blocks.size()));
  telemetry.add(Counter::kPlannedTiles, p.exact_tiles);
  return p;
}

UnitBlocks exact_unit(const StepPlan& plan, const Geometry& g, int64_t u) {
  const PlannedRow& w = plan.rows[plan.unit_row[u]];
  const int64_t start = (u - w.first_unit) * g.tile_blocks;
  return {plan.blocks.data() + w.first_block + start, std::min(g.tile_blocks, w.nb - start)};
}

void check_plan_blocks(const StepPlan& plan, int64_t host_blocks) {
  if (plan.max_block < host_blocks) return;
  // Name the first id out of range, in row-major order of the block table (ids are >= 0: plan_step checked them).
  for (const auto& w : plan.rows) {
    for (int64_t j = 0; j < w.nb; ++j) {
      const int64_t b = plan.blocks[w.first_block + j];
      AKV_CHECK_INDEX(b < host_blocks, "block_table[", w.req, ", ", j, "] must be in [0, ", host_blocks,
                      ") (the KV cache's blocks), got ", b);
    }
  }
}

std::vector<UnitRound> plan_rounds(const StepPlan& plan, const std::vector<UnitBlocks>& units, int64_t pool_blocks,
                                   int64_t num_kv_heads, int64_t threads) {
  std::vector<UnitRound> rounds;
  // held[b]: block b is held by a unit of the current round (one pool slot however many units hold it).
  std::vector<char> held(static_cast<size_t>(plan.max_block + 1), 0);
  int64_t distinct = 0, begin = 0;
  const auto close = [&](int64_t end) {
    int64_t round_rows = 0;
    for (int64_t u = begin; u < end; ++u) {
      if (u == begin || plan.unit_row[u] != plan.unit_row[u - 1]) ++round_rows;
      for (int64_t i = 0; i < units[u].n; ++i) held[units[u].ids[i]] = 0;
    }
    int64_t per_task = num_kv_heads;
    if (round_rows < 2 * threads) {
      per_task = 1;
      for (int64_t p = num_kv_heads; p > 1; --p) {
        if (num_kv_heads % p == 0 && (round_rows * (num_kv_heads / p)) % threads == 0) {
          per_task = p;
          break;
        }
      }
    }
    rounds.push_back({end, per_task});
    begin = end;
    distinct = 0;
  };
  const int64_t n = static_cast<int64_t>(units.size());
  for (int64_t u = 0; u < n; ++u) {
    if (u > begin && units[u].n > pool_blocks - distinct) close(u);
    for (int64_t i = 0; i < units[u].n; ++i) {
      char& h = held[units[u].ids[i]];
      distinct += h == 0 ? 1 : 0;
      h = 1;
    }
  }
  if (n > begin) close(n);
  return rounds;
}

}  // namespace activekv
