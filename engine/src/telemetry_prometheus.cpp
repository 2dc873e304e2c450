// Telemetry as Prometheus families (telemetry.h, prometheus_families): the activekv_* counters, histograms and gauges
// of a process tree's engines as plain structs; the _telemetry module adds labels and exposes them.
#include <activekv/telemetry.h>

#include <charconv>
#include <cmath>

namespace activekv {

namespace {

// Prometheus names of the counters (snapshot key -> metric family name without _total, unit, help), in Counter order.
struct CounterSpec {
  const char* key;
  const char* family;
  const char* unit;
  const char* help;
};
const CounterSpec kCounterSpecs[] = {
    {"build_calls", "activekv_build_calls", "", "Native build entries: one per vLLM step with attention metadata."},
    {"kv_update_calls", "activekv_kv_update_calls", "", "Native KV-update entries: one per layer per step."},
    {"forward_calls", "activekv_forward_calls", "", "Native forward entries with a step plan: one per layer per step."},
    {"forward_skipped", "activekv_forward_skipped", "", "Forward entries without metadata (vLLM warm-up/profiling)."},
    {"request_rows", "activekv_request_rows", "", "Request rows planned by build, summed over steps."},
    {"tokens_written", "activekv_tokens_written", "", "Tokens written into the host tier (padding excluded)."},
    {"padding_slots", "activekv_padding_slots", "", "Slot-mapping entries of -1 (PAD_SLOT_ID) skipped."},
    {"write_through_tokens", "activekv_write_through_tokens", "", "Tokens also written into a resident pool copy."},
    {"blocks_admitted", "activekv_blocks_admitted", "", "KV blocks copied from the host tier into the active pool."},
    {"blocks_evicted", "activekv_blocks_evicted", "", "Resident KV blocks evicted (LRU, unpinned) to make room."},
    {"blocks_hit", "activekv_blocks_hit", "", "KV blocks found resident in the pool when a tile asked for them."},
    {"bytes_h2d", "activekv_host_to_pool_bytes", "bytes", "Bytes copied from the host tier into the active pool."},
    {"bytes_d2h", "activekv_pool_to_host_bytes", "bytes", "Bytes of new K/V copied device to host tier by KV updates (tiered engines; 0 otherwise)."},
    {"tiles_computed", "activekv_tiles_computed", "", "Attention tiles computed (one per request row per tile)."},
    {"host_rebinds", "activekv_host_rebinds", "", "Times a layer's host tier changed storage and its pool was reset."},
    {"compressed_rows", "activekv_compressed_rows", "", "Compressed mode: decode rows that attended a selection."},
    {"compressed_context_blocks", "activekv_compressed_context_blocks", "",
     "Compressed mode: blocks the selecting rows' contexts held."},
    {"selected_blocks", "activekv_selected_blocks", "",
     "Compressed mode: blocks attended, summed over selecting rows and KV heads."},
    {"union_blocks", "activekv_union_blocks", "",
     "Compressed mode: blocks admitted for selecting rows (union over KV heads)."},
    {"planned_blocks", "activekv_planned_blocks", "",
     "Block ids build checked and planned: the context blocks of every row with query tokens."},
    {"planned_tiles", "activekv_planned_tiles", "", "Exact-mode tiles build planned, once per step."},
    {"blocks_in_place", "activekv_blocks_in_place", "",
     "KV blocks attended where they are in the host tier (in-place placement: no pool, no copy)."},
};
static_assert(sizeof kCounterSpecs / sizeof kCounterSpecs[0] == static_cast<size_t>(Counter::kCount),
              "one Prometheus spec per counter, in Counter order");

std::string go_float(double v) {
  if (std::isinf(v)) return "+Inf";
  char buf[32];
  const auto res = std::to_chars(buf, buf + sizeof buf, v);  // shortest round-trip form, as Python's repr
  std::string s(buf, res.ptr);
  // prometheus_client writes integral bounds as 1.0, 2.0, ...: keep the same label values.
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

// Histogram with bucket bounds and sum multiplied by `scale` (microseconds -> seconds).
MetricFamily histogram_family(const std::string& name, const std::string& unit, const std::string& help,
                              const Histogram& h, double scale) {
  MetricFamily f{name, help, unit, "histogram", {}};
  int64_t cumulative = 0;
  for (int b = 0; b < Histogram::kBuckets; ++b) {
    cumulative += h.counts[b];
    f.samples.push_back({name + "_bucket", go_float(Histogram::upper_bound(b) * scale), static_cast<double>(cumulative)});
  }
  f.samples.push_back({name + "_count", "", static_cast<double>(cumulative)});
  f.samples.push_back({name + "_sum", "", h.sum * scale});
  return f;
}

MetricFamily gauge_family(const std::string& name, const std::string& help, double value) {
  return MetricFamily{name, help, "", "gauge", {{name, "", value}}};
}

}  // namespace

std::vector<MetricFamily> prometheus_families(const std::vector<PublishedTelemetry>& published) {
  std::vector<TelemetrySnapshot> all;
  for (const auto& p : published) all.push_back(p.snapshot);
  const TelemetrySnapshot total = merge_snapshots(all);
  std::vector<MetricFamily> out;
  for (const auto& spec : kCounterSpecs) {
    int64_t value = 0;
    for (const auto& [k, v] : total.counters)
      if (k == spec.key) value = v;
    out.push_back(MetricFamily{spec.family, spec.help, spec.unit, "counter",
                               {{std::string(spec.family) + "_total", "", static_cast<double>(value)}}});
  }
  Histogram latency, admitted;
  for (const auto& [k, h] : total.histograms) {
    if (k == "forward_latency_us") latency = h;
    if (k == "blocks_admitted_per_forward") admitted = h;
  }
  out.push_back(histogram_family("activekv_forward_latency_seconds", "seconds",
                                 "Latency of one native forward (one layer, one step), wall clock.", latency, 1e-6));
  out.push_back(histogram_family("activekv_blocks_admitted_per_forward", "",
                                 "KV blocks copied into the pool by one native forward (one layer, one step).",
                                 admitted, 1.0));
  int64_t layers = 0;
  for (const auto& [k, v] : total.info)
    if (k == "num_layers") layers = v;
  out.push_back(gauge_family("activekv_engines", "Live ActiveKV engines in this server's processes.",
                             static_cast<double>(published.size())));
  out.push_back(gauge_family("activekv_layers", "Attention layers served by the live ActiveKV engines.",
                             static_cast<double>(layers)));
  return out;
}

std::vector<std::pair<std::string, std::string>> prometheus_counter_names() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& spec : kCounterSpecs) out.emplace_back(spec.key, std::string(spec.family) + "_total");
  return out;
}

}  // namespace activekv
