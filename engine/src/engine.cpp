#include <activekv/check.h>
#include <activekv/cpu_kernel.h>
#include <activekv/cuda_kernel.h>
#include <activekv/engine.h>

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
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

// Pins of an admitted tile are released even when an exception leaves the loop.
struct TilePins {
  LayerState& layer;
  std::vector<int64_t> slots;
  ~TilePins() { release_tile(layer, slots); }
};
}  // namespace

Kernel parse_kernel(const std::string& name) {
  if (name == "native") return Kernel::kNative;
  AKV_CHECK_VALUE(name == "aten", "kernel must be 'native' or 'aten', got '", name, "'");
  return Kernel::kAten;
}

const char* kernel_name(Kernel kernel) { return kernel == Kernel::kNative ? "native" : "aten"; }

const char* engine_version() { return ACTIVEKV_VERSION; }
const char* engine_torch_version() { return ACTIVEKV_TORCH_VERSION; }

int64_t worst_case_union_blocks(const EngineConfig& c) {
  const auto& g = c.geometry;
  AKV_CHECK_VALUE(c.recent_blocks >= 1, "recent_blocks must be >= 1 (the decode token's own block), got ",
                  c.recent_blocks);
  AKV_CHECK_VALUE(c.sink_blocks >= 0, "sink_blocks must be >= 0, got ", c.sink_blocks);
  const int64_t k = c.budget_tokens / g.block_size - c.sink_blocks - c.recent_blocks;
  AKV_CHECK_VALUE(k >= 1, "budget_tokens (", c.budget_tokens, ") must cover sink_blocks + recent_blocks + one block = ",
                  (c.sink_blocks + c.recent_blocks + 1) * g.block_size, " tokens at block_size ", g.block_size);
  return g.num_kv_heads * k + c.sink_blocks + c.recent_blocks;
}

Transfer parse_transfer(const std::string& name) {
  if (name == "mapped") return Transfer::kMapped;
  if (name == "staged") return Transfer::kStaged;
  AKV_CHECK_VALUE(false, "transfer must be 'mapped' or 'staged', got '", name, "'");
  return Transfer::kMapped;
}

namespace {
// "cuda" means the current CUDA device: pin the index, so device checks compare like with like (cuda:0 == cuda:0).
at::Device with_index(at::Device device) {
  if (device.is_cpu() || device.has_index()) return device;
  return c10::impl::VirtualGuardImpl(device.type()).getDevice();
}
}  // namespace

Engine::Engine(EngineConfig config, at::Device device)
    : config_(std::move(config)), device_(with_index(device)), kv_(config_.geometry, config_.pool_blocks, device_) {
  AKV_CHECK_VALUE(config_.pool_blocks >= config_.geometry.tile_blocks, "pool_blocks (", config_.pool_blocks,
                  ") must be >= tile_blocks (", config_.geometry.tile_blocks,
                  "): the pool must hold one whole tile to stream a context through it");
  const auto& g = config_.geometry;
  if (config_.mode == Mode::kCompressed) {
    const int64_t need = worst_case_union_blocks(config_);
    AKV_CHECK_VALUE(config_.pool_blocks >= need, "pool_blocks (", config_.pool_blocks,
                    ") must hold the worst-case union of one request row's selections: num_kv_heads * k + "
                    "sink_blocks + recent_blocks = ",
                    need, " blocks");
    selection_.sink_blocks = config_.sink_blocks;
    selection_.recent_blocks = config_.recent_blocks;
    selection_.top_k = config_.budget_tokens / g.block_size - config_.sink_blocks - config_.recent_blocks;
  }
  telemetry_.set_info("num_layers", g.num_layers);
  telemetry_.set_info("pool_blocks", config_.pool_blocks);
  telemetry_.set_info("tile_blocks", g.tile_blocks);
  telemetry_.set_info("block_size", g.block_size);
  telemetry_.set_info("bytes_per_block", g.bytes_per_block());
  telemetry_.set_gauge(Gauge::kMode, config_.mode == Mode::kCompressed ? 1 : 0);
  telemetry_.set_gauge(Gauge::kPoolCapacityBlocks, config_.pool_blocks * g.num_layers);
  // A device pool fed from a pinned host tier copies on its own stream (transfer.h), taken once from the pool of
  // streams of the device.
  if (device_.is_cuda())
    copy_stream_ = c10::impl::VirtualGuardImpl(device_.type()).getStreamFromGlobalPool(device_, false);
}

void Engine::set_layer_names(const std::vector<std::string>& names) {
  AKV_CHECK_VALUE(static_cast<int64_t>(names.size()) == geometry().num_layers, "expected ", geometry().num_layers,
                  " layer names, got ", names.size());
  std::unordered_map<std::string, int64_t> m;
  for (size_t i = 0; i < names.size(); ++i) {
    AKV_CHECK_VALUE(m.emplace(names[i], static_cast<int64_t>(i)).second, "layer name '", names[i], "' repeats");
  }
  layer_names_ = std::move(m);
}

int64_t Engine::layer_index(const std::string& name) const {
  auto it = layer_names_.find(name);
  AKV_CHECK_VALUE(it != layer_names_.end(), "layer '", name, "' is not served by this ActiveKV engine");
  return it->second;
}

std::vector<std::pair<int64_t, int64_t>> Engine::resident(int64_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto& l = kv_.layer(layer);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t b = 0; b < l.slot_of_block.size(); ++b)
    if (l.slot_of_block[b] >= 0) out.emplace_back(static_cast<int64_t>(b), l.slot_of_block[b]);
  return out;
}

at::Tensor Engine::pool(int64_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return kv_.layer(layer).pool.clone();
}

at::Tensor Engine::key_min(int64_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto& t = kv_.layer(layer).key_min;
  return t.defined() ? t.clone() : t;
}

at::Tensor Engine::key_max(int64_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto& t = kv_.layer(layer).key_max;
  return t.defined() ? t.clone() : t;
}

std::vector<std::pair<int64_t, at::Tensor>> Engine::last_selection(int64_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<int64_t, at::Tensor>> out;
  for (const auto& [row, ids] : kv_.layer(layer).last_selection) out.emplace_back(row, ids.clone());
  return out;
}

Engine::HostBinding Engine::host_binding(int64_t layer, const at::Tensor& kv_cache) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto& host = kv_.layer(layer).host;
  if (!host.defined()) return HostBinding::kUnbound;
  return kv_cache.defined() && host.data_ptr() == kv_cache.data_ptr() ? HostBinding::kThis : HostBinding::kOther;
}

void Engine::check_layer(int64_t layer) const {
  AKV_CHECK_INDEX(layer >= 0 && layer < geometry().num_layers, "layer must be in [0, ", geometry().num_layers,
                  "), got ", layer);
}

StepPlan Engine::build(const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
                       int64_t num_reqs, int64_t num_actual_tokens) {
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
  std::lock_guard<std::mutex> lock(mu_);
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
    AKV_CHECK_VALUE(geometry().blocks_for(sl[r]) <= width, "seq_lens[", r, "] = ", sl[r], " needs ",
                    geometry().blocks_for(sl[r]), " blocks but block_table has ", width, " columns");
    // Block ids of the columns the row uses: never negative (their upper bound, the KV cache's block count, is
    // checked by forward, which sees the cache).
    const int32_t* row = p.block_table.data_ptr<int32_t>() + r * width;
    if (lq == 0) continue;
    for (int64_t j = 0, nb = geometry().blocks_for(sl[r]); j < nb; ++j)
      AKV_CHECK_INDEX(row[j] >= 0, "block_table[", r, ", ", j, "] must be a block id >= 0, got ", row[j]);
  }
  AKV_CHECK_VALUE(qsl[num_reqs] <= num_actual_tokens, "query_start_loc[num_reqs] (", qsl[num_reqs],
                  ") must be <= num_actual_tokens (", num_actual_tokens, ")");
  telemetry_.add(Counter::kBuildCalls);
  telemetry_.add(Counter::kRequestRows, num_reqs);
  p.build_id = telemetry_.get(Counter::kBuildCalls);
  return p;
}

void Engine::update_kv(int64_t layer, const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping) {
  check_layer(layer);
  auto host = kv_.host_view(kv_cache);
  check_writable(kv_cache, "kv_cache");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"key", &key}, {"value", &value}})
    AKV_CHECK_VALUE(!t->defined() || !t->requires_grad(), name, " must not require grad");
  std::lock_guard<std::mutex> lock(mu_);
  c10::AutoGradMode no_grad(false);
  kv_.write(layer, host, key, value, slot_mapping, telemetry_);
  telemetry_.add(Counter::kKvUpdateCalls);
}

void Engine::forward(int64_t layer, const StepPlan& plan, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& output, double scale) {
  const auto t0 = std::chrono::steady_clock::now();
  check_layer(layer);
  const auto& g = geometry();
  const int64_t h = g.num_heads, d = g.head_size;
  const int32_t* qsl = plan.query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = plan.seq_lens.data_ptr<int32_t>();
  const int64_t used = qsl[plan.num_reqs];
  AKV_CHECK_TYPE(query.defined() && query.scalar_type() == g.dtype, "query must have dtype ", g.dtype, ", got ",
                 query.defined() ? c10::toString(query.scalar_type()) : "None");
  AKV_CHECK_VALUE(query.dim() == 3 && query.size(0) >= used && query.size(1) == h && query.size(2) == d,
                  "query must be [>= ", used, ", ", h, ", ", d, "], got ", shape_str(query.sizes()));
  AKV_CHECK_VALUE(query.device() == device_, "query must be on ", device_, ", got ", query.device());
  AKV_CHECK_TYPE(output.defined() && output.scalar_type() == query.scalar_type(), "output must have dtype ",
                 query.scalar_type(), ", got ", output.defined() ? c10::toString(output.scalar_type()) : "None");
  const bool out_ok = (output.dim() == 3 && output.size(1) == h && output.size(2) == d) ||
                      (output.dim() == 2 && output.size(1) == h * d);
  AKV_CHECK_VALUE(out_ok && output.size(0) >= used && output.is_contiguous(), "output must be contiguous [>= ", used,
                  ", ", h, ", ", d, "] or [>= ", used, ", ", h * d, "], got ", shape_str(output.sizes()));
  AKV_CHECK_VALUE(output.device() == device_, "output must be on ", device_, ", got ", output.device());
  AKV_CHECK_VALUE(std::isfinite(scale), "scale must be a finite number, got ", scale);
  auto host = kv_.host_view(kv_cache);
  check_writable(output, "output");
  check_writable(kv_cache, "kv_cache");
  check_has_data(query, "query");
  AKV_CHECK_VALUE(!query.requires_grad(), "query must not require grad (ActiveKV computes without autograd)");
  // output is written while query and the KV cache are read
  check_no_overlap(output, "output", kv_cache, "kv_cache");
  check_no_overlap(output, "output", query, "query");
  std::lock_guard<std::mutex> lock(mu_);
  c10::AutoGradMode no_grad(false);
  const int64_t host_blocks = host.size(0);
  // Validate every block id the plan will touch before admitting any: nothing is half-applied on bad input.
  const int64_t width = plan.block_table.size(1);
  const int32_t* bt = plan.block_table.data_ptr<int32_t>();
  for (int64_t r = 0; r < plan.num_reqs; ++r) {
    if (qsl[r + 1] == qsl[r]) continue;
    const int64_t nb = g.blocks_for(sl[r]);
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t b = bt[r * width + j];
      AKV_CHECK_INDEX(b >= 0 && b < host_blocks, "block_table[", r, ", ", j, "] must be in [0, ", host_blocks,
                      ") (the KV cache's blocks), got ", b);
    }
  }
  kv_.bind_host(layer, host, telemetry_);
  auto& L = kv_.layer(layer);
  telemetry_.add(Counter::kForwardCalls);
  L.last_selection.clear();
  auto out3 = output.view({output.size(0), h, d});
  const int64_t admitted_before = telemetry_.get(Counter::kBlocksAdmitted);
  auto rows = plan_rows(L, plan, query);
  if (use_native()) {
    forward_native(L, host, query, rows, out3, scale);
  } else {  // one unit admitted and computed at a time
    for (auto& w : rows) {
      for (size_t u = 0; u < w.num_units(); ++u) {
        TilePins pins{L, {}};
        const auto slots = admit_unit(L, host, w.unit(u), pins.slots);
        if (w.sel.has_value()) {
          attend_selected(L, w, slots, scale);
        } else {
          attend_tile(L, w, static_cast<int64_t>(u), slots, scale);
        }
      }
    }
  }
  if (!use_native())  // forward_native writes its rows' outputs itself
    for (auto& w : rows) out3.narrow(0, w.q0, w.lq).copy_(ungroup_output(online_softmax_finish(w.st), w.lq));
  const int64_t admitted = telemetry_.get(Counter::kBlocksAdmitted) - admitted_before;
  telemetry_.observe_blocks_admitted(admitted);
  const auto us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  telemetry_.observe_forward_latency_us(us);
  // Gauges for the HTTP health route: occupied slots (a slot is freed only by a page-table reset, so next_free
  // counts them), and when the last forward ended (wall clock: another process compares it with its own clock).
  int64_t resident = 0;
  for (int64_t i = 0; i < g.num_layers; ++i) resident += kv_.layer(i).next_free;
  telemetry_.set_gauge(Gauge::kPoolResidentBlocks, resident);
  telemetry_.set_gauge(Gauge::kLastForwardUs, static_cast<int64_t>(us));
  telemetry_.set_gauge(Gauge::kLastStepUnixUs,
                       std::chrono::duration_cast<std::chrono::microseconds>(
                           std::chrono::system_clock::now().time_since_epoch()).count());
}

}  // namespace activekv

namespace activekv {

std::vector<Engine::RowWork> Engine::plan_rows(LayerState& L, const StepPlan& plan, const at::Tensor& query) {
  const auto& g = geometry();
  const int32_t* qsl = plan.query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = plan.seq_lens.data_ptr<int32_t>();
  const int32_t* bt = plan.block_table.data_ptr<int32_t>();
  const int64_t width = plan.block_table.size(1), budget_blocks = selection_.per_head();
  std::vector<RowWork> rows;
  rows.reserve(plan.num_reqs);
  struct Selecting {
    size_t work;  // index in rows
    int64_t r, nb;
    const int32_t* block_row;
    at::Tensor q;
  };
  std::vector<Selecting> selecting;
  for (int64_t r = 0; r < plan.num_reqs; ++r) {
    const int64_t q0 = qsl[r], lq = static_cast<int64_t>(qsl[r + 1]) - qsl[r], seq = sl[r];
    if (lq == 0) continue;
    const int64_t nb = g.blocks_for(seq);
    const int32_t* block_row = bt + r * width;
    auto q = query.narrow(0, q0, lq);
    RowWork& w = rows.emplace_back();
    w.q0 = q0;
    w.lq = lq;
    w.seq = seq;
    if (!use_native()) {  // forward_native groups every row's query in one buffer of its own
      w.qg = group_query(q, g.num_kv_heads);
      if (use_cuda_kernel(w.qg.size(1))) w.qg = w.qg.contiguous();  // read by pointer
      w.st = online_softmax_init(g.num_kv_heads, w.qg.size(1), g.head_size, device_);
    }
    if (config_.mode == Mode::kCompressed && lq == 1 && nb > budget_blocks) {
      selecting.push_back({rows.size() - 1, r, nb, block_row, q});
    } else {
      w.tiles = exact_tiles(block_row, nb, g.tile_blocks);
    }
  }
  // Compressed decode rows: score and choose (Quest bound, top-k), then record in row order. With at least two such
  // rows per thread on the CPU kernel, one parallel region chooses for all of them, a row per task (each row's scoring
  // then runs on its task's thread); otherwise row by row, each row's scoring split over the threads. Each block's
  // score is computed alone in a fixed order either way, so the choices are the same.
  std::vector<RowChoice> choices(selecting.size());
  const auto choose = [&](size_t i) {
    choices[i] = choose_row(L, selecting[i].block_row, selecting[i].nb, selecting[i].q);
  };
  const int64_t n = static_cast<int64_t>(selecting.size());
  if (use_native() && n >= 2 * at::get_num_threads()) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) choose(static_cast<size_t>(i));
    });
  } else {
    for (size_t i = 0; i < selecting.size(); ++i) choose(i);
  }
  for (size_t i = 0; i < selecting.size(); ++i)
    rows[selecting[i].work].sel = select_row(L, selecting[i].block_row, selecting[i].r, choices[i]);
  return rows;
}

std::vector<int64_t> Engine::admit_unit(LayerState& L, const at::Tensor& host, const std::vector<int64_t>& blocks,
                                        std::vector<int64_t>& pinned) {
  auto adm = admit_tile(L, blocks, clock_);
  pinned.insert(pinned.end(), adm.slots.begin(), adm.slots.end());
  if (!adm.miss_blocks.empty()) {
    int64_t bytes = 0;
    if (copy_stream_.has_value() && host.is_cpu()) {  // tiered
      bytes = config_.transfer == Transfer::kMapped
                  ? copy_blocks_mapped(host, L.pool, adm.miss_blocks, adm.miss_slots, *copy_stream_)
                  : copy_blocks_staged(host, L.pool, adm.miss_blocks, adm.miss_slots, *copy_stream_);
    } else {
      bytes = copy_blocks(host, L.pool, adm.miss_blocks, adm.miss_slots);
    }
    telemetry_.add(Counter::kBytesH2D, bytes);
    telemetry_.add(Counter::kBlocksAdmitted, static_cast<int64_t>(adm.miss_blocks.size()));
  }
  telemetry_.add(Counter::kBlocksHit, adm.hits);
  telemetry_.add(Counter::kBlocksEvicted, adm.evicted);
  return std::move(adm.slots);
}

void Engine::attend_tile(LayerState& L, RowWork& w, int64_t tile, const std::vector<int64_t>& slots, double scale) {
  const int64_t bs = geometry().block_size, tb = geometry().tile_blocks, n = static_cast<int64_t>(slots.size());
  if (use_cuda_kernel(w.qg.size(1))) {  // the CPU kernel runs in forward_native
    const int64_t kvh = geometry().num_kv_heads;
    std::vector<int64_t> head_slots(kvh * n), pos(kvh * n);
    for (int64_t hh = 0; hh < kvh; ++hh) {
      for (int64_t j = 0; j < n; ++j) {
        head_slots[hh * n + j] = slots[j];
        pos[hh * n + j] = tile * tb + j;
      }
    }
    cuda_tile(L, head_slots, pos, n, w.seq - w.lq, w.lq, w.qg, w.st, scale);
  } else {
    auto gathered = gather_tile(L.pool, index_tensor(slots, device_));  // [KVH, 2, n, bs, D]
    auto mask = tile_mask(w.seq - w.lq, w.lq, tile * tb * bs, n * bs, device_);
    online_softmax_tile(w.st, w.qg, gathered, mask, scale);
  }
  telemetry_.add(Counter::kTilesComputed);
}

Engine::RowChoice Engine::choose_row(const LayerState& L, const int32_t* row, int64_t nb, const at::Tensor& q) const {
  const std::vector<int64_t> ids(row, row + nb);
  RowChoice c;
  c.row_blocks = index_tensor(ids, at::kCPU);  // one copy on CPU, a second only for a device pool
  c.pos = select_blocks(q, L.key_min, L.key_max, device_.is_cpu() ? c.row_blocks : index_tensor(ids, device_),
                        selection_, /*native_scores=*/use_native());  // [KVH, m] positions
  return c;
}

Engine::RowSelection Engine::select_row(LayerState& L, const int32_t* row, int64_t r, const RowChoice& choice) {
  const int64_t kvh = geometry().num_kv_heads, m = selection_.per_head(), nb = choice.row_blocks.size(0);
  RowSelection sel;
  sel.pos = choice.pos;
  sel.pos_cpu = choice.pos.to(at::kCPU).contiguous();
  const int64_t* pp = sel.pos_cpu.data_ptr<int64_t>();
  // The pool admits the union of the heads' blocks, in position order, all pinned while the row attends.
  sel.union_pos.assign(pp, pp + kvh * m);
  std::sort(sel.union_pos.begin(), sel.union_pos.end());
  sel.union_pos.erase(std::unique(sel.union_pos.begin(), sel.union_pos.end()), sel.union_pos.end());
  for (int64_t p : sel.union_pos) sel.union_blocks.push_back(row[p]);
  L.last_selection.emplace_back(r, choice.row_blocks.index_select(0, sel.pos_cpu.view({-1})).view({kvh, m}));
  telemetry_.add(Counter::kCompressedRows);
  telemetry_.add(Counter::kCompressedContextBlocks, nb);
  telemetry_.add(Counter::kSelectedBlocks, kvh * m);
  telemetry_.add(Counter::kUnionBlocks, static_cast<int64_t>(sel.union_blocks.size()));
  return sel;
}

std::vector<int64_t> Engine::RowSelection::head_slots(const std::vector<int64_t>& union_slots, int64_t kvh) const {
  const int64_t m = pos_cpu.size(1);
  const int64_t* pp = pos_cpu.data_ptr<int64_t>();
  std::vector<int64_t> out(kvh * m);
  for (int64_t i = 0; i < kvh * m; ++i)
    out[i] = union_slots[std::lower_bound(union_pos.begin(), union_pos.end(), pp[i]) - union_pos.begin()];
  return out;
}

void Engine::attend_selected(LayerState& L, RowWork& w, const std::vector<int64_t>& union_slots, double scale) {
  const auto& g = geometry();
  const int64_t kvh = g.num_kv_heads, bs = g.block_size, tb = g.tile_blocks, m = selection_.per_head();
  const int64_t seq = w.seq;
  const auto& qg = w.qg;
  auto& st = w.st;
  const auto& pos = w.sel->pos;
  const int64_t* pp = w.sel->pos_cpu.data_ptr<int64_t>();
  const auto head_slots = w.sel->head_slots(union_slots, kvh);
  if (use_cuda_kernel(qg.size(1))) {
    // Tiles of tile_blocks per head, as the ATen path below (same tile count in telemetry).
    for (int64_t t = 0; t < m; t += tb) {
      const int64_t n = std::min(tb, m - t);
      std::vector<int64_t> slots(kvh * n), tpos(kvh * n);
      for (int64_t hh = 0; hh < kvh; ++hh) {
        for (int64_t j = 0; j < n; ++j) {
          slots[hh * n + j] = head_slots[hh * m + t + j];
          tpos[hh * n + j] = pp[hh * m + t + j];
        }
      }
      cuda_tile(L, slots, tpos, n, seq - 1, 1, qg, st, scale);
      telemetry_.add(Counter::kTilesComputed);
    }
  } else {
    // Each head gathers its own blocks: row h*m + j of [KVH * m, 2, bs, D] is (block pos[h, j], head h). The pool
    // [P, KVH, 2, bs, D] viewed as [P * KVH, 2, bs, D] has K and V of one (block, head) in one contiguous row.
    std::vector<int64_t> flat(kvh * m);
    for (int64_t i = 0; i < kvh * m; ++i) flat[i] = head_slots[i] * kvh + i / m;
    auto per_head = L.pool.view({L.pool.size(0) * kvh, 2, bs, g.head_size})
                        .index_select(0, index_tensor(flat, device_))
                        .view({kvh, m, 2, bs, g.head_size})
                        .permute({0, 2, 1, 3, 4});  // [KVH, 2, m, bs, D]
    auto offsets = at::arange(bs, at::TensorOptions().dtype(at::kLong).device(device_));
    for (int64_t t = 0; t < m; t += tb) {
      const int64_t n = std::min(tb, m - t);
      // Per-head causal mask of the decode token (position seq - 1): only the unwritten tail of the last block.
      auto kpos = pos.narrow(1, t, n).unsqueeze(2).mul(bs).add(offsets).reshape({kvh, n * bs});
      auto mask = kpos.gt(seq - 1).view({kvh, 1, 1, n * bs});
      online_softmax_tile(st, qg, per_head.narrow(2, t, n), mask, scale);
      telemetry_.add(Counter::kTilesComputed);
    }
  }
}

}  // namespace activekv

namespace activekv {

bool Engine::use_cuda_kernel(int64_t rows) const {
  return config_.kernel == Kernel::kNative && device_.is_cuda() && cuda_attend() != nullptr &&
         cuda_kernel_supports(geometry().head_size, rows);
}

void Engine::cuda_tile(LayerState& L, const std::vector<int64_t>& slots, const std::vector<int64_t>& pos, int64_t n,
                       int64_t first_query_pos, int64_t lq, const at::Tensor& qg, OnlineSoftmax& st, double scale) {
  CudaAttendArgs a;
  a.pool = L.pool;
  a.slots = index_tensor(slots, device_);
  a.pos = index_tensor(pos, device_);
  a.n = n;
  a.first_query_pos = first_query_pos;
  a.num_q = lq;
  a.q = qg;
  a.m = st.m;
  a.l = st.l;
  a.acc = st.acc;
  a.scale = scale;
  cuda_attend()(a);
}

namespace {

// Query rows of the CPU kernel, grouped per KV head as group_query lays them out: of a request row whose grouped rows
// start at q, KV head hh, group member gi and token t is row hh * G * lq + gi * lq + t of q [rows, D] float32 (and of
// q_bf16, the bfloat16 query as given, where non-null). Plain loops over the query's strides: no ATen op per row.
template <typename T>
void group_rows(const at::Tensor& query, int64_t q0, int64_t lq, int64_t kvh, int64_t group, int64_t d, float* q,
                at::BFloat16* q_bf16) {
  const T* src = query.data_ptr<T>();
  const int64_t s0 = query.stride(0), s1 = query.stride(1), s2 = query.stride(2);
  for (int64_t hh = 0; hh < kvh; ++hh)
    for (int64_t gi = 0; gi < group; ++gi)
      for (int64_t t = 0; t < lq; ++t) {
        const T* x = src + (q0 + t) * s0 + (hh * group + gi) * s1;
        const int64_t row = (hh * group + gi) * lq + t;
        for (int64_t j = 0; j < d; ++j) q[row * d + j] = static_cast<float>(x[j * s2]);
        if constexpr (std::is_same_v<T, at::BFloat16>)
          if (q_bf16 != nullptr)
            for (int64_t j = 0; j < d; ++j) q_bf16[row * d + j] = x[j * s2];
      }
}

// out[q0 + t, hh * G + gi, :] = acc / l of that grouped row (online_softmax_finish and ungroup_output of the ATen
// path: one float32 division per element, then the output dtype's rounding). out: [tokens, heads, D] contiguous.
template <typename T>
void finish_rows(const float* acc, const float* l, int64_t q0, int64_t lq, int64_t kvh, int64_t group, int64_t d,
                 const at::Tensor& out) {
  T* dst = out.data_ptr<T>();
  const int64_t heads = kvh * group;
  for (int64_t hh = 0; hh < kvh; ++hh)
    for (int64_t gi = 0; gi < group; ++gi)
      for (int64_t t = 0; t < lq; ++t) {
        const int64_t row = (hh * group + gi) * lq + t;
        T* o = dst + ((q0 + t) * heads + hh * group + gi) * d;
        for (int64_t j = 0; j < d; ++j) o[j] = static_cast<T>(acc[row * d + j] / l[row]);
      }
}

}  // namespace

// The CPU kernel's forward: one parallel region per round over the whole batch, not one per request row.
//
// The rows' admission units, in request order (plan_rows), are admitted while each fits beside those held, as the
// ATen / CUDA paths admit them one at a time: a held unit's slots are the newest in LRU order, so no unit that fits
// would have evicted them, and pins are released in admission order, so the slots, hits, evictions, LRU order and
// telemetry are those of one unit at a time (checked against the ATen path on the parity cells). When the next unit
// does not fit, or after the last one, the kernel runs over every (request row, KV head) with blocks in the round:
// tasks split over ATen's intra-op threads, each task's blocks attended in order by one thread, in tiles of
// tile_blocks (the kernel's online-softmax merge unit; rounds hold whole tiles, so a row's arithmetic does not depend
// on the rounds, the pool size or the thread count).
void Engine::forward_native(LayerState& L, const at::Tensor& host, const at::Tensor& query, std::vector<RowWork>& rows,
                            const at::Tensor& out3, double scale) {
  const auto& g = geometry();
  const int64_t kvh = g.num_kv_heads, d = g.head_size, bs = g.block_size, tb = g.tile_blocks;
  const int64_t group = g.num_heads / kvh;
  const int64_t pool = static_cast<int64_t>(L.block_of_slot.size());
  // A row's blocks in the current round: pool slots and row positions of head hh at [hh * head_stride, + count).
  // Every head of an exact row reads the same blocks (head_stride 0); a compressed row's heads read m each.
  struct Round {
    std::vector<int64_t> slots, pos;
    int64_t head_stride = 0;
  };
  std::vector<Round> round(rows.size());
  // Every row's grouped query and online-softmax state (running max, sum, accumulator) in one buffer each: row i's
  // grouped rows start at first[i] (kvh * G * lq of them).
  std::vector<int64_t> first(rows.size() + 1, 0);
  for (size_t i = 0; i < rows.size(); ++i) first[i + 1] = first[i] + kvh * group * rows[i].lq;
  const int64_t total = first.back();
  std::vector<float> qbuf(total * d), mbuf(total, -std::numeric_limits<float>::infinity()), lbuf(total, 0.f),
      accbuf(total * d, 0.f);
  // The query rounded to bfloat16 (exactly the model's bfloat16 query) where the kernel reads it.
  std::vector<at::BFloat16> qb16(g.dtype == at::kBFloat16 && cpu_kernel_uses_bf16_query(d) ? total * d : 0);
  for (size_t i = 0; i < rows.size(); ++i) {
    float* q = qbuf.data() + first[i] * d;
    at::BFloat16* qb = qb16.empty() ? nullptr : qb16.data() + first[i] * d;
    switch (g.dtype) {
      case at::kFloat: group_rows<float>(query, rows[i].q0, rows[i].lq, kvh, group, d, q, qb); break;
      case at::kBFloat16: group_rows<at::BFloat16>(query, rows[i].q0, rows[i].lq, kvh, group, d, q, qb); break;
      case at::kHalf: group_rows<at::Half>(query, rows[i].q0, rows[i].lq, kvh, group, d, q, qb); break;
      default: AKV_CHECK_TYPE(false, "the CPU kernel supports float32, bfloat16 and float16, got ", g.dtype);
    }
  }
  TilePins pins{L, {}};  // the round's slots in admission order
  int64_t round_tiles = 0;
  const auto* pool_bytes = static_cast<const char*>(L.pool.data_ptr());
  const int64_t run_bytes = 2 * bs * d * static_cast<int64_t>(L.pool.element_size());  // K and V of (block, head)

  auto run_round = [&]() {
    // Tasks: (row, first KV head, heads). A task walks its heads tile by tile (a tile's slots hold every head's K and
    // V side by side: [P, KVH, 2, bs, D]), so the more heads per task, the closer the pool is read to its address
    // order. With at least two rows per thread a task is a whole row; with fewer, a task is the most heads (a divisor
    // of the KV heads) that still give every thread the same number of tasks (one head per task if none does).
    int64_t round_rows = 0;
    for (const auto& rr : round) round_rows += rr.slots.empty() ? 0 : 1;
    const int64_t threads = at::get_num_threads();
    int64_t per_task = kvh;
    if (round_rows < 2 * threads) {
      per_task = 1;
      for (int64_t p = kvh; p > 1; --p) {
        if (kvh % p == 0 && (round_rows * (kvh / p)) % threads == 0) {
          per_task = p;
          break;
        }
      }
    }
    std::vector<std::pair<size_t, int64_t>> tasks;  // (row, first head)
    for (size_t i = 0; i < rows.size(); ++i)
      if (!round[i].slots.empty())
        for (int64_t h0 = 0; h0 < kvh; h0 += per_task) tasks.emplace_back(i, h0);
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<const void*> ptrs;
      AttendArgs a;
      a.dtype = g.dtype;
      a.block_size = bs;
      a.head_size = d;
      a.scale = scale;
      a.chunk_blocks = tb;
      for (int64_t t = begin; t < end; ++t) {
        RowWork& row = rows[tasks[t].first];
        const Round& rr = round[tasks[t].first];
        const int64_t h0 = tasks[t].second, nrows = group * row.lq, base = first[tasks[t].first];
        const int64_t count = rr.head_stride > 0 ? rr.head_stride : static_cast<int64_t>(rr.slots.size());
        a.rows = nrows;
        a.num_q = row.lq;
        a.first_query_pos = row.seq - row.lq;
        // Exact rows: tile after tile, head after head (every head reads the same slots, whose K and V of all heads
        // lie side by side, so the pool is read close to its address order). Compressed rows: head after head, each
        // head's blocks in one call (the heads' blocks differ, so nothing is shared between them, and the kernel then
        // prefetches across tiles). Each (row, head) sees its blocks in order, in tiles of tb, either way.
        const int64_t step = rr.head_stride > 0 ? count : tb;
        for (int64_t j = 0; j < count; j += step) {
          const int64_t n = std::min(step, count - j);
          for (int64_t hh = h0; hh < h0 + per_task; ++hh) {
            const int64_t* slots = rr.slots.data() + hh * rr.head_stride + j;
            ptrs.resize(n);
            for (int64_t i = 0; i < n; ++i) ptrs[i] = pool_bytes + (slots[i] * kvh + hh) * run_bytes;
            a.q = qbuf.data() + (base + hh * nrows) * d;
            a.q_bf16 = qb16.empty() ? nullptr : qb16.data() + (base + hh * nrows) * d;
            a.num_blocks = n;
            a.kv = ptrs.data();
            a.block_pos = rr.pos.data() + hh * rr.head_stride + j;
            a.m = mbuf.data() + base + hh * nrows;
            a.l = lbuf.data() + base + hh * nrows;
            a.acc = accbuf.data() + (base + hh * nrows) * d;
            attend_blocks_cpu(a);
          }
        }
      }
    });
    for (auto& rr : round) {
      rr.slots.clear();
      rr.pos.clear();
    }
    release_tile(L, pins.slots);
    pins.slots.clear();
    telemetry_.add(Counter::kTilesComputed, round_tiles);
    round_tiles = 0;
  };

  for (size_t i = 0; i < rows.size(); ++i) {
    RowWork& w = rows[i];
    Round& rr = round[i];
    for (size_t u = 0; u < w.num_units(); ++u) {
      const auto& blocks = w.unit(u);
      // Run the round first when the unit does not fit beside the held ones.
      if (!pins.slots.empty() && static_cast<int64_t>(blocks.size()) > pool - L.pinned_slots) run_round();
      const auto slots = admit_unit(L, host, blocks, pins.slots);
      if (w.sel.has_value()) {
        const int64_t m = selection_.per_head();
        const int64_t* pp = w.sel->pos_cpu.data_ptr<int64_t>();
        rr.slots = w.sel->head_slots(slots, kvh);
        rr.pos.assign(pp, pp + kvh * m);
        rr.head_stride = m;
        round_tiles += (m + tb - 1) / tb;  // counted as the tiles of tile_blocks the other paths compute
      } else {
        rr.slots.insert(rr.slots.end(), slots.begin(), slots.end());
        for (size_t j = 0; j < slots.size(); ++j)
          rr.pos.push_back(static_cast<int64_t>(u) * tb + static_cast<int64_t>(j));
        ++round_tiles;
      }
    }
  }
  if (!pins.slots.empty()) run_round();
  for (size_t i = 0; i < rows.size(); ++i) {
    const float* acc = accbuf.data() + first[i] * d;
    const float* l = lbuf.data() + first[i];
    switch (g.dtype) {
      case at::kFloat: finish_rows<float>(acc, l, rows[i].q0, rows[i].lq, kvh, group, d, out3); break;
      case at::kBFloat16: finish_rows<at::BFloat16>(acc, l, rows[i].q0, rows[i].lq, kvh, group, d, out3); break;
      default: finish_rows<at::Half>(acc, l, rows[i].q0, rows[i].lq, kvh, group, d, out3); break;
    }
  }
}

}  // namespace activekv
