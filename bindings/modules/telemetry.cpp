// activekv._telemetry: snapshots of every live ActiveKV engine in this process (engine/include/activekv/telemetry.h).
#include <activekv/telemetry.h>
#include <activekv_py/common.h>

namespace py = pybind11;
using activekv::py_glue::snapshot_to_dict;

PYBIND11_MODULE(_telemetry, m) {
  m.doc() = "ActiveKV telemetry: counters and histograms of the live engines in this process.";
  activekv::py_glue::register_exceptions(m);
  m.def(
      "engine_snapshots",
      []() {
        py::list out;
        for (const auto& [id, s] : activekv::snapshot_live_engines()) {
          py::dict d = snapshot_to_dict(s);
          d["engine_id"] = id;
          out.append(d);
        }
        return out;
      },
      "One snapshot dict per live engine, in creation order (each with its engine_id).");
  m.def(
      "snapshot",
      []() {
        // Counters and info summed over live engines; histograms merged bucket by bucket.
        activekv::TelemetrySnapshot total;
        const auto all = activekv::snapshot_live_engines();
        for (const auto& [id, s] : all) {
          if (total.counters.empty()) {
            total = s;
            continue;
          }
          for (size_t i = 0; i < s.counters.size(); ++i) total.counters[i].second += s.counters[i].second;
          for (size_t i = 0; i < s.histograms.size(); ++i) {
            auto& h = total.histograms[i].second;
            const auto& o = s.histograms[i].second;
            for (int b = 0; b < activekv::Histogram::kBuckets; ++b) h.counts[b] += o.counts[b];
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
        }
        py::dict d = snapshot_to_dict(total);
        d["engines"] = static_cast<int64_t>(all.size());
        return d;
      },
      "Counters and histograms summed over every live engine, plus 'engines' (how many); info holds num_layers "
      "summed and the other facts where every engine agrees. Empty counters when no engine is alive.");
  py::list names;
  for (int i = 0; i < static_cast<int>(activekv::Counter::kCount); ++i)
    names.append(activekv::counter_name(static_cast<activekv::Counter>(i)));
  m.attr("COUNTERS") = py::tuple(names);
}
