#include <activekv/telemetry.h>

#include <cmath>
#include <limits>

namespace activekv {

namespace {
struct Registry {
  std::mutex mu;
  int64_t next_id = 0;
  std::map<int64_t, const Telemetry*> live;
};
Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: engines may outlive static destruction order
  return *r;
}
}  // namespace

const char* counter_name(Counter c) {
  switch (c) {
    case Counter::kBuildCalls: return "build_calls";
    case Counter::kKvUpdateCalls: return "kv_update_calls";
    case Counter::kForwardCalls: return "forward_calls";
    case Counter::kForwardSkipped: return "forward_skipped";
    case Counter::kRequestRows: return "request_rows";
    case Counter::kTokensWritten: return "tokens_written";
    case Counter::kPaddingSlots: return "padding_slots";
    case Counter::kWriteThroughTokens: return "write_through_tokens";
    case Counter::kBlocksAdmitted: return "blocks_admitted";
    case Counter::kBlocksEvicted: return "blocks_evicted";
    case Counter::kBlocksHit: return "blocks_hit";
    case Counter::kBytesH2D: return "bytes_h2d";
    case Counter::kBytesD2H: return "bytes_d2h";
    case Counter::kTilesComputed: return "tiles_computed";
    case Counter::kHostRebinds: return "host_rebinds";
    case Counter::kCompressedRows: return "compressed_rows";
    case Counter::kCompressedContextBlocks: return "compressed_context_blocks";
    case Counter::kSelectedBlocks: return "selected_blocks";
    case Counter::kUnionBlocks: return "union_blocks";
    case Counter::kCount: break;
  }
  return "unknown";
}

double Histogram::upper_bound(int i) {
  return i >= kBuckets - 1 ? std::numeric_limits<double>::infinity() : std::ldexp(1.0, i);
}

void Histogram::observe(double value) {
  int i = 0;
  while (i < kBuckets - 1 && value > upper_bound(i)) ++i;
  ++counts[i];
  ++count;
  sum += value;
}

Telemetry::Telemetry(bool registered) : registered_(registered) {
  if (!registered_) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  id_ = r.next_id++;
  r.live[id_] = this;
}

Telemetry::~Telemetry() {
  if (!registered_) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.live.erase(id_);
}

void Telemetry::observe_forward_latency_us(double us) {
  std::lock_guard<std::mutex> lock(mu_);
  forward_latency_us_.observe(us);
}

void Telemetry::observe_blocks_admitted(int64_t blocks) {
  std::lock_guard<std::mutex> lock(mu_);
  blocks_admitted_per_forward_.observe(static_cast<double>(blocks));
}

void Telemetry::set_info(const std::string& key, int64_t value) {
  std::lock_guard<std::mutex> lock(mu_);
  info_[key] = value;
}

TelemetrySnapshot Telemetry::snapshot() const {
  TelemetrySnapshot s;
  for (int i = 0; i < static_cast<int>(Counter::kCount); ++i)
    s.counters.emplace_back(counter_name(static_cast<Counter>(i)), counters_[i].load(std::memory_order_relaxed));
  std::lock_guard<std::mutex> lock(mu_);
  s.histograms.emplace_back("forward_latency_us", forward_latency_us_);
  s.histograms.emplace_back("blocks_admitted_per_forward", blocks_admitted_per_forward_);
  s.info.assign(info_.begin(), info_.end());
  return s;
}

void Telemetry::reset() {
  for (auto& c : counters_) c.store(0, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);
  forward_latency_us_ = Histogram();
  blocks_admitted_per_forward_ = Histogram();
}

std::vector<std::pair<int64_t, TelemetrySnapshot>> snapshot_live_engines() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::pair<int64_t, TelemetrySnapshot>> out;
  for (const auto& [id, t] : r.live) out.emplace_back(id, t->snapshot());
  return out;
}

}  // namespace activekv
