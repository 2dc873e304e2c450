// Telemetry as Prometheus families (telemetry.h, prometheus_families): the activekv_* counters, histograms and gauges
// of a process tree's engines as plain structs; the _telemetry module adds labels and exposes them.
#include <activekv/telemetry.h>

#include <cmath>
#include <string>

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
    {"decode_batch_rows", "activekv_decode_batch_rows", "",
     "Decode rows attended by one CUDA launch for the step's whole batch (every block they read on the device)."},
};
static_assert(sizeof kCounterSpecs / sizeof kCounterSpecs[0] == static_cast<size_t>(Counter::kCount),
              "one Prometheus spec per counter, in Counter order");

// A bucket bound as prometheus_client writes its `le` label (utils.floatToGoString): repr(float) ("1.0", "0.004096"),
// Go's exponent form from 1e6 on ("1.048576e+06" for repr's "1048576.0"), "+Inf" for the last.
std::string go_float(double v) {
  if (std::isinf(v) && v > 0) return "+Inf";
  const std::string s = float_repr(v);
  const size_t dot = s.find('.');
  if (!(v > 0) || dot == std::string::npos || dot <= 6) return s;
  std::string mantissa = s.substr(0, 1) + "." + s.substr(1, dot - 1) + s.substr(dot + 1);
  mantissa.erase(mantissa.find_last_not_of("0.") + 1);
  const std::string exponent = std::to_string(dot - 1);
  return mantissa + "e+" + (exponent.size() < 2 ? "0" : "") + exponent;
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

MetricFamily gauge_family(const std::string& name, const std::string& help, double value,
                          const std::string& unit = "") {
  return MetricFamily{name, help, unit, "gauge", {{name, "", value}}};
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
  // The engines' gauges (Gauge, merged as merge_snapshots does): the numbers of the /activekv/health route.
  const auto gauge = [&](Gauge g) -> int64_t {
    for (const auto& [k, v] : total.gauges)
      if (k == gauge_name(g)) return v;
    return 0;
  };
  out.push_back(gauge_family("activekv_mode",
                             "Attention mode of the live ActiveKV engines: 0 exact, 1 compressed; -1 when they differ "
                             "or none is live.",
                             published.empty() ? -1.0 : static_cast<double>(gauge(Gauge::kMode))));
  out.push_back(gauge_family("activekv_pool_resident_blocks",
                             "Active-pool slots holding a KV block after each layer's last forward, summed over "
                             "layers and engines.",
                             static_cast<double>(gauge(Gauge::kPoolResidentBlocks))));
  out.push_back(gauge_family("activekv_pool_capacity_blocks",
                             "Active-pool slots, summed over layers and engines (pool_blocks x layers).",
                             static_cast<double>(gauge(Gauge::kPoolCapacityBlocks))));
  out.push_back(gauge_family("activekv_last_step_timestamp_seconds",
                             "Unix time at the end of the latest native forward of any engine; 0 before the first.",
                             static_cast<double>(gauge(Gauge::kLastStepUnixUs)) * 1e-6, "seconds"));
  out.push_back(gauge_family("activekv_last_forward_seconds",
                             "Wall time of that latest native forward (one layer, one step); 0 before the first.",
                             static_cast<double>(gauge(Gauge::kLastForwardUs)) * 1e-6, "seconds"));
  out.push_back(gauge_family("activekv_key_metadata_bytes",
                             "Bytes of per-block key min/max (compressed mode's selection metadata) held, summed over "
                             "layers and engines; 0 in exact mode, which keeps none.",
                             static_cast<double>(gauge(Gauge::kKeyMetadataBytes)), "bytes"));
  return out;
}

std::vector<std::pair<std::string, std::string>> prometheus_counter_names() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& spec : kCounterSpecs) out.emplace_back(spec.key, std::string(spec.family) + "_total");
  return out;
}

}  // namespace activekv
