// The engine (engine.h): construction, inspection, and the three per-step entry points. build plans the step once
// (step_plan.cpp); forward checks its inputs, selects (selection.cpp), then admits the units of the step round by round
// into the layer's pool and has the engine's forward path (forward_path.h) compute each round.
#include <activekv/check.h>
#include <activekv/engine.h>

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <chrono>
#include <cmath>
#include <memory>

#include "forward_path.h"

namespace activekv {

namespace {

// Pins of admitted units are released even when an exception leaves the loop.
struct TilePins {
  LayerState& layer;
  std::vector<int64_t> slots;
  ~TilePins() { release_tile(layer, slots); }
};

// Adds a layer's change of occupied slots to the engine's running total when it leaves scope, exception or not.
struct ResidentDelta {
  int64_t& total;
  const LayerState& layer;
  int64_t before = layer.next_free;
  ~ResidentDelta() { total += layer.next_free - before; }
};

// "cuda" means the current CUDA device: pin the index, so device checks compare like with like (cuda:0 == cuda:0).
at::Device with_index(at::Device device) {
  if (device.is_cpu() || device.has_index()) return device;
  return c10::impl::VirtualGuardImpl(device.type()).getDevice();
}

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
  // Each count at most 2^40 (the options' range), so the sums and products below stay in int64.
  AKV_CHECK_VALUE(c.recent_blocks >= 1 && c.recent_blocks <= kMaxSelectionCount,
                  "recent_blocks must be in [1, 2^40] (the decode token's own block), got ", c.recent_blocks);
  AKV_CHECK_VALUE(c.sink_blocks >= 0 && c.sink_blocks <= kMaxSelectionCount, "sink_blocks must be in [0, 2^40], got ",
                  c.sink_blocks);
  AKV_CHECK_VALUE(c.budget_tokens >= 0 && c.budget_tokens <= kMaxSelectionCount,
                  "budget_tokens must be in [0, 2^40], got ", c.budget_tokens);
  const int64_t k = c.budget_tokens / g.block_size - c.sink_blocks - c.recent_blocks;
  AKV_CHECK_VALUE(k >= 1, "budget_tokens (", c.budget_tokens, ") must cover sink_blocks + recent_blocks + one block = ",
                  (c.sink_blocks + c.recent_blocks + 1) * g.block_size, " tokens at block_size ", g.block_size);
  int64_t heads_k = 0;
  AKV_CHECK_VALUE(!__builtin_mul_overflow(g.num_kv_heads, k, &heads_k) && heads_k <= kMaxSelectionCount,
                  "num_kv_heads * k = ", g.num_kv_heads, " * ", k, " blocks must stay below 2^40");
  return heads_k + c.sink_blocks + c.recent_blocks;
}

Transfer parse_transfer(const std::string& name) {
  if (name == "mapped") return Transfer::kMapped;
  if (name == "staged") return Transfer::kStaged;
  AKV_CHECK_VALUE(false, "transfer must be 'mapped' or 'staged', got '", name, "'");
  return Transfer::kMapped;
}

Placement parse_placement(const std::string& name) {
  if (name == "pool") return Placement::kPool;
  AKV_CHECK_VALUE(name == "in_place", "placement must be 'pool' or 'in_place', got '", name, "'");
  return Placement::kInPlace;
}

const char* placement_name(Placement placement) { return placement == Placement::kInPlace ? "in_place" : "pool"; }

void check_engine_config(const EngineConfig& c, at::Device device) {
  if (c.placement == Placement::kInPlace) {
    AKV_CHECK_VALUE(device.is_cpu() || device.is_cuda(), "placement 'in_place' needs the CPU or a CUDA device (the "
                    "host tier and the attention on one memory), got device ", device, "; use placement 'pool'");
    AKV_CHECK_VALUE(c.pool_blocks == 0, "placement 'in_place' has no pool: pool_blocks must be 0, got ",
                    c.pool_blocks);
  } else {
    AKV_CHECK_VALUE(c.pool_blocks >= c.geometry.tile_blocks, "pool_blocks (", c.pool_blocks,
                    ") must be >= tile_blocks (", c.geometry.tile_blocks,
                    "): the pool must hold one whole tile to stream a context through it");
  }
  if (c.mode != Mode::kCompressed) return;
  const int64_t need = worst_case_union_blocks(c);
  AKV_CHECK_VALUE(c.placement == Placement::kInPlace || c.pool_blocks >= need, "pool_blocks (", c.pool_blocks,
                  ") must hold the worst-case union of one request row's selections: num_kv_heads * k + "
                  "sink_blocks + recent_blocks = ", need, " blocks");
  AKV_CHECK_VALUE(c.dense_layers >= 0 && c.dense_layers <= c.geometry.num_layers,
                  "dense_layers must be in [0, num_layers = ", c.geometry.num_layers, "], got ", c.dense_layers);
}

namespace {

// The configuration's checks, before the KV state allocates a pool.
const EngineConfig& checked(const EngineConfig& c, at::Device device) {
  check_engine_config(c, device);
  return c;
}

}  // namespace

Engine::Engine(EngineConfig config, at::Device device)
    : config_(checked(config, with_index(device))),
      device_(with_index(device)),
      kv_(config_.geometry, config_.pool_blocks, device_, config_.mode == Mode::kCompressed) {
  const auto& g = config_.geometry;
  if (config_.mode == Mode::kCompressed) {
    selection_.sink_blocks = config_.sink_blocks;
    selection_.recent_blocks = config_.recent_blocks;
    selection_.top_k = config_.budget_tokens / g.block_size - config_.sink_blocks - config_.recent_blocks;
  }
  telemetry_.set_info("num_layers", g.num_layers);
  telemetry_.set_info("pool_blocks", config_.pool_blocks);
  telemetry_.set_info("in_place", in_place() ? 1 : 0);
  telemetry_.set_info("tile_blocks", g.tile_blocks);
  telemetry_.set_info("block_size", g.block_size);
  telemetry_.set_info("bytes_per_block", g.bytes_per_block());
  telemetry_.set_gauge(Gauge::kMode, config_.mode == Mode::kCompressed ? 1 : 0);
  telemetry_.set_gauge(Gauge::kPoolCapacityBlocks, config_.pool_blocks * g.num_layers);
  // A device pool fed from a pinned host tier copies on its own stream (transfer.h), taken once from the pool of
  // streams of the device.
  if (device_.is_cuda())
    copy_stream_ = c10::impl::VirtualGuardImpl(device_.type()).getStreamFromGlobalPool(device_, false);
  path_ = make_forward_path(config_.kernel, config_.geometry, selection_, device_, telemetry_);
}

Engine::~Engine() = default;

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

bool Engine::serves_layer(const std::string& name) const { return layer_names_.count(name) != 0; }

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

void Engine::check_in_place_host(const at::Tensor& host) const {
  AKV_CHECK_VALUE(!in_place() || host.device() == device_, "placement 'in_place' reads blocks where they are: "
                  "kv_cache must be on ", device_, ", got ", host.device(), host.is_pinned() ? " (pinned)" : "",
                  "; use placement 'pool' for a host tier in host memory");
}

void Engine::check_layer(int64_t layer) const {
  AKV_CHECK_INDEX(layer >= 0 && layer < geometry().num_layers, "layer must be in [0, ", geometry().num_layers,
                  "), got ", layer);
}

StepPlan Engine::build(const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
                       int64_t num_reqs, int64_t num_actual_tokens, const at::Tensor& slot_mapping) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t per_head = config_.mode == Mode::kCompressed ? selection_.per_head() : 0;
  StepPlan p = plan_step(geometry(), query_start_loc, seq_lens, block_table, num_reqs, num_actual_tokens, per_head,
                         device_, telemetry_);
  step_slots_ = device_.is_cuda() && slot_mapping.defined() && slot_mapping.device() == device_
                    ? check_step_slots(slot_mapping)
                    : CheckedSlots();
  // After the copies of device metadata to the host above (plan_step's, check_step_slots'), which waited for the
  // stream's earlier KV updates; a flag set by an update still queued shows at a later build.
  TORCH_CHECK(!kv_.take_write_error(), "a CUDA KV update since the previous step found a slot_mapping entry outside "
              "the KV cache and wrote nothing for that token: its slot mapping changed after Engine::build checked "
              "it (the step's metadata and its KV updates must use the same slot mapping)");
  // The rounds, unless a layer's selection sizes a unit.
  const auto exact_rounds = [&](StepPlan& s) {
    std::vector<UnitBlocks> units(s.num_units());
    for (int64_t u = 0; u < s.num_units(); ++u) units[u] = exact_unit(s, geometry(), u);
    s.rounds_pool = round_capacity();
    s.rounds_threads = at::get_num_threads();
    s.rounds = plan_rounds(s, units, s.rounds_pool, geometry().num_kv_heads, s.rounds_threads);
  };
  if (path_->batches_units() && !p.selecting) exact_rounds(p);
  path_->plan_batch(p);
  // The dense layers' plan: the same rows, none selecting (its checks and counts are the plan's above, done once).
  std::shared_ptr<StepPlan> dense;
  if (p.selecting && config_.dense_layers > 0) {
    dense = std::make_shared<StepPlan>(plan_step(geometry(), query_start_loc, seq_lens, block_table, num_reqs,
                                                 num_actual_tokens, 0, device_, dense_plan_counts_));
    if (path_->batches_units()) exact_rounds(*dense);
    path_->plan_batch(*dense);
  }
  telemetry_.add(Counter::kBuildCalls);
  telemetry_.add(Counter::kRequestRows, num_reqs);
  p.build_id = telemetry_.get(Counter::kBuildCalls);
  if (dense) {
    dense->build_id = p.build_id;
    p.dense = std::move(dense);
  }
  return p;
}

void Engine::update_kv(int64_t layer, const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping) {
  check_layer(layer);
  auto host = kv_.host_view(kv_cache);
  check_in_place_host(host);
  check_writable(kv_cache, "kv_cache");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"key", &key}, {"value", &value}})
    AKV_CHECK_VALUE(!t->defined() || !t->requires_grad(), name, " must not require grad");
  std::lock_guard<std::mutex> lock(mu_);
  c10::AutoGradMode no_grad(false);
  ResidentDelta resident{resident_blocks_, kv_.layer(layer)};  // a rebind empties the layer's pool
  kv_.write(layer, host, key, value, slot_mapping, telemetry_, &step_slots_);
  telemetry_.add(Counter::kKvUpdateCalls);
  if (const c10::Stream* copy = tier_stream(host)) {
    // The write may still be queued on the compute stream: the copy stream's later gathers of the host tier wait for
    // it on the device, a CPU gather (staged transfer) on the host.
    if (!host_written_.has_value()) host_written_.emplace(device_.type());
    host_written_->record(c10::impl::VirtualGuardImpl(device_.type()).getStream(device_));
    host_written_->block(*copy);
    host_write_pending_ = true;
  }
}

void Engine::forward(int64_t layer, const StepPlan& step_plan, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& output, double scale) {
  const auto t0 = std::chrono::steady_clock::now();
  check_layer(layer);
  // A dense layer (EngineConfig::dense_layers) attends every block: the step's plan without selection.
  const StepPlan& plan = step_plan.dense && layer < config_.dense_layers ? *step_plan.dense : step_plan;
  const auto& g = geometry();
  const int64_t h = g.num_heads, d = g.head_size;
  const int64_t used = plan.query_start_loc.data_ptr<int32_t>()[plan.num_reqs];
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
  check_in_place_host(host);
  check_writable(output, "output");
  check_writable(kv_cache, "kv_cache");
  check_has_data(query, "query");
  AKV_CHECK_VALUE(!query.requires_grad(), "query must not require grad (ActiveKV computes without autograd)");
  // output is written while query and the KV cache are read
  check_no_overlap(output, "output", kv_cache, "kv_cache");
  check_no_overlap(output, "output", query, "query");
  std::lock_guard<std::mutex> lock(mu_);
  c10::AutoGradMode no_grad(false);
  // Every block id the plan will touch, against this cache, before admitting any: nothing is half-applied.
  check_plan_blocks(plan, host.size(0));
  auto& L = kv_.layer(layer);
  ResidentDelta resident{resident_blocks_, L};
  kv_.bind_host(layer, host, telemetry_);
  telemetry_.add(Counter::kForwardCalls);
  L.last_selection.clear();
  const int64_t admitted_before = telemetry_.get(Counter::kBlocksAdmitted);
  const auto selections = plan.selecting
                              ? select_rows(plan, L, query, selection_, path_->scoring(), telemetry_)
                              : std::vector<RowSelection>();
  const auto out3 = output.view({output.size(0), h, d});
  LayerStep step{plan, L, in_place() ? host : L.pool, query, out3, scale, selections};
  step.upload = tier_stream(host);
  // The decode batch (StepPlan::batch): its rows in one launch when every block they read is on the device: in place,
  // or all resident in the pool (touched as admitting them would, no copy; the kernel finds their slots in the page
  // table on the device). Launched before any admission of the other rows, so a slot those evict is overwritten on
  // the stream only after the launch has read it. Otherwise its rows are admitted with the others.
  if (!plan.batch.empty() && path_->batch_fits(step)) {
    if (in_place()) {
      step.batch = true;
      telemetry_.add(Counter::kBlocksInPlace, static_cast<int64_t>(plan.batch.blocks.size()));
    } else if (touch_resident(L, plan.batch.blocks, clock_)) {
      step.batch = true;
      step.page = kv_.device_page(layer);
      telemetry_.add(Counter::kBlocksHit, static_cast<int64_t>(plan.batch.blocks.size()));
    }
  }
  path_->begin(step);
  if (step.batch) path_->attend_batch(step);
  // The other rows (every row, without the batch): their units admitted round by round.
  if (!step.batch || plan.batch.rows.size() < plan.rows.size()) {
    // The step's units: exact tiles from the plan, a selecting row's union from this layer's selection.
    std::vector<UnitBlocks> units(plan.num_units());
    for (int64_t u = 0; u < plan.num_units(); ++u) {
      const auto i = static_cast<size_t>(plan.unit_row[u]);
      units[u] = plan.rows[i].selects ? UnitBlocks{selections[i].union_blocks.data(),
                                                   static_cast<int64_t>(selections[i].union_blocks.size())}
                                      : exact_unit(plan, g, u);
    }
    // Rounds: one unit each, or for a batching path the plan's (made at build when no unit depends on the layer).
    std::vector<UnitRound> own;
    const std::vector<UnitRound>* rounds = &plan.rounds;
    if (!path_->batches_units()) {
      own.resize(units.size());
      for (size_t u = 0; u < units.size(); ++u) own[u].end = static_cast<int64_t>(u) + 1;
      rounds = &own;
    } else if (plan.selecting || plan.rounds_pool != round_capacity() ||
               plan.rounds_threads != at::get_num_threads()) {
      own = plan_rounds(plan, units, round_capacity(), g.num_kv_heads, at::get_num_threads());
      rounds = &own;
    }
    // The admission loop: a round's units admitted (pinned) in order, computed together, then released in order. In
    // place, a unit's "slots" are its block ids in the host tier, which the path reads as it reads a pool (the same
    // [blocks, num_kv_heads, 2, block_size, head_size] layout): nothing is admitted, pinned or copied.
    std::vector<AdmittedUnit> admitted;
    int64_t begin = 0;
    for (const auto& round : *rounds) {
      TilePins pins{L, {}};
      admitted.clear();
      for (int64_t u = begin; u < round.end; ++u) {
        if (step.batch && plan.batch.member[plan.unit_row[u]]) continue;
        if (in_place()) {
          admitted.push_back({u, std::vector<int64_t>(units[u].ids, units[u].ids + units[u].n)});
          telemetry_.add(Counter::kBlocksInPlace, units[u].n);
        } else {
          admitted.push_back({u, admit_unit(L, host, units[u], pins.slots)});
        }
      }
      if (!admitted.empty()) path_->attend(step, admitted, round.heads_per_task);
      begin = round.end;
    }
  }
  path_->finish(step);
  const int64_t admitted_blocks = telemetry_.get(Counter::kBlocksAdmitted) - admitted_before;
  telemetry_.observe_blocks_admitted(admitted_blocks);
  const auto us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  telemetry_.observe_forward_latency_us(us);
  // Gauges for the HTTP health route: occupied slots (a slot is freed only by a page-table reset, so next_free counts
  // them; the engine keeps their sum as KV updates and forwards change it), and when the last forward ended (wall
  // clock: another process compares it with its own clock).
  telemetry_.set_gauge(Gauge::kPoolResidentBlocks, resident_blocks_ + (L.next_free - resident.before));
  telemetry_.set_gauge(Gauge::kLastForwardUs, static_cast<int64_t>(us));
  telemetry_.set_gauge(Gauge::kLastStepUnixUs,
                       std::chrono::duration_cast<std::chrono::microseconds>(
                           std::chrono::system_clock::now().time_since_epoch()).count());
}

std::vector<int64_t> Engine::admit_unit(LayerState& L, const at::Tensor& host, UnitBlocks blocks,
                                        std::vector<int64_t>& pinned) {
  auto adm = admit_tile(L, blocks.ids, blocks.n, clock_);
  pinned.insert(pinned.end(), adm.slots.begin(), adm.slots.end());
  if (!adm.miss_blocks.empty()) {
    int64_t bytes = 0;
    if (const c10::Stream* copy = tier_stream(host)) {
      if (config_.transfer == Transfer::kStaged && host_write_pending_) {
        host_written_->synchronize();  // the CPU gather reads what the device wrote
        host_write_pending_ = false;
      }
      bytes = config_.transfer == Transfer::kMapped
                  ? copy_blocks_mapped_unchecked(host, L.pool, adm.miss_blocks, adm.miss_slots, *copy)
                  : copy_blocks_staged(host, L.pool, adm.miss_blocks, adm.miss_slots, *copy);
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

}  // namespace activekv
