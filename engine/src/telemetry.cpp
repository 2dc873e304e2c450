// One engine's telemetry (telemetry.h): counter and gauge names, histograms, the Telemetry methods that count and
// read (its page's creation and removal are telemetry_page.cpp), the live engines' snapshots and their merge.
#include "telemetry_page.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace activekv {

using namespace telemetry_detail;

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
    case Counter::kPlannedBlocks: return "planned_blocks";
    case Counter::kPlannedTiles: return "planned_tiles";
    case Counter::kBlocksInPlace: return "blocks_in_place";
    case Counter::kDecodeBatchRows: return "decode_batch_rows";
    case Counter::kCount: break;
  }
  return "unknown";
}

const char* gauge_name(Gauge g) {
  switch (g) {
    case Gauge::kMode: return "mode";
    case Gauge::kPoolResidentBlocks: return "pool_resident_blocks";
    case Gauge::kPoolCapacityBlocks: return "pool_capacity_blocks";
    case Gauge::kLastStepUnixUs: return "last_step_unix_us";
    case Gauge::kLastForwardUs: return "last_forward_us";
    case Gauge::kKeyMetadataBytes: return "key_metadata_bytes";
    case Gauge::kCount: break;
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

void Telemetry::add(Counter c, int64_t n) {
  page_->counters[static_cast<int>(c)].fetch_add(n, std::memory_order_relaxed);
}

int64_t Telemetry::get(Counter c) const {
  return page_->counters[static_cast<int>(c)].load(std::memory_order_relaxed);
}

void Telemetry::observe_forward_latency_us(double us) { observe(page_->hist[0], us); }

void Telemetry::observe_blocks_admitted(int64_t blocks) { observe(page_->hist[1], static_cast<double>(blocks)); }

void Telemetry::set_gauge(Gauge g, int64_t value) {
  page_->gauges[static_cast<int>(g)].store(value, std::memory_order_relaxed);
}

void Telemetry::set_info(const std::string& key, int64_t value) {
  std::lock_guard<std::mutex> lock(mu_);
  info_[key] = value;
  const int n = page_->info_count.load(std::memory_order_relaxed);
  for (int i = 0; i < n; ++i) {
    if (key == page_->info[i].key) {
      page_->info[i].value.store(value, std::memory_order_relaxed);
      return;
    }
  }
  if (n >= kInfoSlots || key.size() >= static_cast<size_t>(kInfoKey)) return;  // kept in memory only
  std::memcpy(page_->info[n].key, key.c_str(), key.size() + 1);
  page_->info[n].value.store(value, std::memory_order_relaxed);
  page_->info_count.store(n + 1, std::memory_order_release);
}

void Telemetry::set_json_path(const std::string& path) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  json_path_ = path;
  if (path.size() < static_cast<size_t>(kJsonPath)) {  // a longer path is written by this process only
    std::memcpy(page_->json_path, path.c_str(), path.size() + 1);
    page_->json_path_len.store(static_cast<int32_t>(path.size()), std::memory_order_release);
  }
  if (!path.empty() && !r.atexit_registered) {
    std::atexit(write_all_json_at_exit);
    r.atexit_registered = true;
  }
}

TelemetrySnapshot Telemetry::snapshot() const {
  TelemetrySnapshot s = read_page(*page_);
  std::lock_guard<std::mutex> lock(mu_);
  s.info.assign(info_.begin(), info_.end());
  return s;
}

void Telemetry::reset() {
  for (auto& c : page_->counters) c.store(0, std::memory_order_relaxed);
  for (auto& h : page_->hist) {
    for (auto& b : h.counts) b.store(0, std::memory_order_relaxed);
    h.sum_bits.store(0, std::memory_order_relaxed);
  }
}

std::vector<std::pair<int64_t, TelemetrySnapshot>> snapshot_live_engines() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::pair<int64_t, TelemetrySnapshot>> out;
  for (const auto& [id, t] : r.live) out.emplace_back(id, t->snapshot());
  return out;
}

TelemetrySnapshot merge_snapshots(const std::vector<TelemetrySnapshot>& all) {
  TelemetrySnapshot total;
  for (const auto& s : all) {
    if (total.counters.empty()) {
      total = s;
      continue;
    }
    for (size_t i = 0; i < s.counters.size() && i < total.counters.size(); ++i)
      total.counters[i].second += s.counters[i].second;
    for (size_t i = 0; i < s.histograms.size() && i < total.histograms.size(); ++i) {
      auto& h = total.histograms[i].second;
      const auto& o = s.histograms[i].second;
      for (int b = 0; b < Histogram::kBuckets; ++b) h.counts[b] += o.counts[b];
      h.count += o.count;
      h.sum += o.sum;
    }
    // info: num_layers adds up (layers served); any other fact is kept only where every engine agrees.
    std::vector<std::pair<std::string, int64_t>> merged;
    for (const auto& [tk, tv] : total.info) {
      for (const auto& [k, v] : s.info) {
        if (k != tk) continue;
        if (k == "num_layers") merged.emplace_back(k, tv + v);
        else if (v == tv) merged.emplace_back(k, tv);
      }
    }
    total.info = std::move(merged);
    // gauges: mode kept where every engine agrees (else -1), pool and memory gauges summed, the last forward of the
    // latest step.
    if (s.gauges.size() == total.gauges.size() && s.gauges.size() == static_cast<size_t>(kGauges)) {
      auto& g = total.gauges;
      const auto at = [](Gauge k) { return static_cast<size_t>(k); };
      if (g[at(Gauge::kMode)].second != s.gauges[at(Gauge::kMode)].second) g[at(Gauge::kMode)].second = -1;
      g[at(Gauge::kPoolResidentBlocks)].second += s.gauges[at(Gauge::kPoolResidentBlocks)].second;
      g[at(Gauge::kPoolCapacityBlocks)].second += s.gauges[at(Gauge::kPoolCapacityBlocks)].second;
      g[at(Gauge::kKeyMetadataBytes)].second += s.gauges[at(Gauge::kKeyMetadataBytes)].second;
      if (s.gauges[at(Gauge::kLastStepUnixUs)].second > g[at(Gauge::kLastStepUnixUs)].second) {
        g[at(Gauge::kLastStepUnixUs)].second = s.gauges[at(Gauge::kLastStepUnixUs)].second;
        g[at(Gauge::kLastForwardUs)].second = s.gauges[at(Gauge::kLastForwardUs)].second;
      }
    }
  }
  return total;
}

}  // namespace activekv
