// activekv._telemetry: snapshots of the live ActiveKV engines of this process and of its descendant processes
// (engine/include/activekv/telemetry.h), and the Prometheus side of vLLM's stat-logger contract: a collector whose
// collect() exposes the engine's activekv_* metric families (prometheus_families) at scrape time, with its labels.
#include <activekv/telemetry.h>
#include <activekv_py/common.h>

#include <algorithm>
#include <cstdio>
#include <optional>

namespace py = pybind11;
using activekv::py_glue::snapshot_to_dict;

namespace {

// A sample, shaped as prometheus_client's Sample named tuple (the fields its exposition code reads).
struct Sample {
  std::string name;
  py::dict labels;
  double value = 0;
};

// A metric family, shaped as prometheus_client's Metric (name, documentation, unit, type, samples).
struct MetricFamily {
  std::string name, documentation, unit, type;
  py::list samples;
};

// The engine's activekv_* families of this process tree (prometheus_families), each sample with the collector's
// labels (and its bucket's le).
py::list families(const py::dict& labels) {
  std::vector<activekv::MetricFamily> native;
  {
    py::gil_scoped_release release;
    native = activekv::prometheus_families(activekv::snapshot_process_tree());
  }
  py::list out;
  for (const auto& f : native) {
    MetricFamily family{f.name, f.help, f.unit, f.type, py::list()};
    for (const auto& s : f.samples) {
      py::dict l;
      for (auto item : labels) l[item.first] = item.second;
      if (!s.le.empty()) l["le"] = s.le;
      family.samples.append(py::cast(Sample{s.name, l, s.value}));
    }
    out.append(py::cast(std::move(family)));
  }
  return out;
}

// prometheus_client's custom-collector protocol: collect() and describe() return metric families.
struct Collector {
  py::dict labels;
};

// vLLM's stat-logger contract (AggregateStatLoggerBase): constructed once by AsyncLLM in the API server process.
struct StatLogger {
  py::object collector;
};

// UTF-8 of a str, or nullopt when it has none (a lone surrogate, as os.fsdecode makes of undecodable bytes).
std::optional<std::string> utf8_of(const py::handle& s) {
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(s.ptr(), &size);
  if (data == nullptr) {
    PyErr_Clear();
    return std::nullopt;
  }
  return std::string(data, static_cast<size_t>(size));
}

bool is_label_name(const std::string& n) {
  const auto head = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; };
  if (n.empty() || !head(n[0])) return false;
  return std::all_of(n.begin() + 1, n.end(), [&](char c) { return head(c) || (c >= '0' && c <= '9'); });
}

// A copy of `labels` whose every name and value a scrape can write: prometheus_client escapes values but fails on a
// value that is not a str or not UTF-8, and writes names it does not check (an invalid one breaks the scraper's
// parser, '__' ones are Prometheus' own), on every scrape from then on. The copy keeps later changes of the
// caller's dict out.
py::dict checked_labels(const py::dict& labels) {
  py::dict out;
  for (auto [key, value] : labels) {
    TORCH_CHECK_TYPE(py::isinstance<py::str>(key), "Collector labels: label names must be str, got ",
                     std::string(py::repr(key)));
    const auto name = utf8_of(key);
    TORCH_CHECK_VALUE(name && is_label_name(*name),
                      "Collector labels: label name must match [a-zA-Z_][a-zA-Z0-9_]*, got ",
                      std::string(py::repr(key)));
    TORCH_CHECK_VALUE(name->rfind("__", 0) != 0,
                      "Collector labels: label name must not start with '__' (reserved for Prometheus), got '", *name,
                      "'");
    TORCH_CHECK_VALUE(*name != "le",
                      "Collector labels: label name must not be 'le' (the histograms' bucket label), got '", *name,
                      "'");
    TORCH_CHECK_TYPE(py::isinstance<py::str>(value), "Collector labels: the value of '", *name,
                     "' must be a str, got ", std::string(py::repr(value)));
    TORCH_CHECK_VALUE(utf8_of(value).has_value(), "Collector labels: the value of '", *name,
                      "' must be valid UTF-8 text, got ", std::string(py::repr(value)));
    out[key] = value;
  }
  return out;
}

py::dict model_labels(const py::handle& vllm_config) {
  py::dict labels;
  py::object name = vllm_config.attr("model_config").attr("served_model_name");
  if (py::isinstance<py::list>(name) || py::isinstance<py::tuple>(name)) name = name[py::int_(0)];
  labels["model_name"] = py::str(name);
  return checked_labels(labels);
}

// The telemetry_json option of vLLM's configuration (additional_config['activekv']['telemetry_json']), or "" when it
// is absent or not a plain str path (the engine core's Builder reports those).
std::string configured_telemetry_json(const py::handle& vllm_config) {
  py::object extra = py::getattr(vllm_config, "additional_config", py::none());
  if (!py::isinstance<py::dict>(extra)) return "";
  py::dict d = extra.cast<py::dict>();
  if (!d.contains("activekv") || !py::isinstance<py::dict>(d["activekv"])) return "";
  py::dict opts = d["activekv"].cast<py::dict>();
  if (!opts.contains("telemetry_json") || !py::isinstance<py::str>(opts["telemetry_json"])) return "";
  const auto path = activekv::py_glue::fs_path_of(opts["telemetry_json"]);  // the bytes the Builder records
  return path && path->find('\0') == std::string::npos ? *path : "";
}

}  // namespace

PYBIND11_MODULE(_telemetry, m) {
  m.doc() =
      "ActiveKV telemetry: counters and histograms of the live engines in this process and its descendants, and "
      "the activekv_* Prometheus collector behind vLLM's stat-logger contract.";
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
      "One snapshot dict per live engine of this process, in creation order (each with its engine_id).");
  m.def(
      "snapshot",
      []() {
        std::vector<activekv::TelemetrySnapshot> all;
        for (auto& [id, s] : activekv::snapshot_live_engines()) all.push_back(std::move(s));
        py::dict d = snapshot_to_dict(activekv::merge_snapshots(all));
        d["engines"] = static_cast<int64_t>(all.size());
        return d;
      },
      "Every counter and histogram summed over the live engines of this process, plus 'engines' (how many); info "
      "holds num_layers summed and the other facts where every engine agrees. Counters are empty when no engine "
      "is alive.");
  m.def(
      "process_tree_snapshots",
      []() {
        std::vector<activekv::PublishedTelemetry> published;
        {
          py::gil_scoped_release release;
          published = activekv::snapshot_process_tree();
        }
        py::list out;
        for (const auto& p : published) {
          py::dict d = snapshot_to_dict(p.snapshot);
          d["pid"] = p.pid;
          d["engine_id"] = p.engine_id;
          out.append(d);
        }
        return out;
      },
      "One snapshot dict (with pid and engine_id) per live engine of this process and of every process descended "
      "from it (read from their shared segments in telemetry_dir()).");
  m.def("float_repr", &activekv::float_repr, py::arg("value"),
        "value as repr(float) writes it (the shortest digits that read back exactly): the form of the activekv_* "
        "histograms' le labels on /metrics and of the HTTP routes' JSON numbers.");
  m.def("telemetry_dir", &activekv::telemetry_dir,
        "Folder of this user's telemetry segments: <base>/activekv-telemetry-<uid>, the base being "
        "$ACTIVEKV_TELEMETRY_DIR, else /dev/shm.");
  m.def(
      "snapshot_json", []() {
        std::vector<activekv::TelemetrySnapshot> all;
        for (auto& [id, s] : activekv::snapshot_live_engines()) all.push_back(std::move(s));
        return activekv::snapshot_to_json(activekv::merge_snapshots(all));
      },
      "snapshot() of this process as the JSON text the telemetry_json option writes.");
  py::list names;
  for (int i = 0; i < static_cast<int>(activekv::Counter::kCount); ++i)
    names.append(activekv::counter_name(static_cast<activekv::Counter>(i)));
  m.attr("COUNTERS") = py::tuple(names);
  py::dict metric_names;
  for (const auto& [key, sample] : activekv::prometheus_counter_names()) metric_names[py::str(key)] = sample;
  m.attr("METRIC_NAMES") = metric_names;

  py::class_<Sample>(m, "Sample", "One exposition sample (the fields of prometheus_client's Sample).")
      .def_readonly("name", &Sample::name)
      .def_readonly("labels", &Sample::labels)
      .def_readonly("value", &Sample::value)
      .def_property_readonly("timestamp", [](const Sample&) { return py::none(); })
      .def_property_readonly("exemplar", [](const Sample&) { return py::none(); })
      .def_property_readonly("native_histogram", [](const Sample&) { return py::none(); })
      .def("__repr__", [](const Sample& s) {
        return "Sample(" + s.name + ", " + py::repr(s.labels).cast<std::string>() + ", " + std::to_string(s.value) + ")";
      });
  py::class_<MetricFamily>(m, "MetricFamily", "One metric family (the fields of prometheus_client's Metric).")
      .def_readonly("name", &MetricFamily::name)
      .def_readonly("documentation", &MetricFamily::documentation)
      .def_readonly("unit", &MetricFamily::unit)
      .def_readonly("type", &MetricFamily::type)
      .def_readonly("samples", &MetricFamily::samples)
      .def("__repr__", [](const MetricFamily& f) { return "MetricFamily(" + f.name + ", " + f.type + ")"; });
  py::class_<Collector>(m, "Collector",
                        "A prometheus_client collector: collect() reads the process tree's telemetry at each scrape.")
      .def(py::init([](const py::dict& labels) { return Collector{checked_labels(labels)}; }),
           py::arg("labels") = py::dict(),
           "labels: {name: value} added to every sample, str to str; names match [a-zA-Z_][a-zA-Z0-9_]*, not '__...' "
           "nor 'le', values are UTF-8 text (escaped in exposition). TypeError/ValueError otherwise.")
      .def("collect", [](const Collector& c) { return families(c.labels); },
           "Every activekv_* metric family: counters (_total), forward latency (seconds) and blocks admitted per "
           "forward histograms, engines and layers gauges.")
      .def("describe", [](const Collector& c) { return families(c.labels); },
           "The same families (prometheus_client registers their names).");
  py::class_<StatLogger>(m, "StatLogger",
                         "vLLM's AggregateStatLoggerBase contract. The constructor (start-up, API server process) "
                         "calls registry_getter() (vLLM's get_prometheus_registry) once and registers a Collector "
                         "labelled with the served model name (ValueError when it is not UTF-8 text), and lets this "
                         "process write the telemetry_json file its additional_config names for engine-core "
                         "processes that end with os._exit; record() and log_engine_initialized() do nothing: the "
                         "values are read from the engines at scrape time, never pushed per step.")
      .def(py::init([](py::object vllm_config, py::object engine_indexes, py::object registry_getter) {
             TORCH_CHECK_TYPE(py::hasattr(vllm_config, "model_config"),
                              "vllm_config must be vLLM's VllmConfig (with a model_config), got ",
                              std::string(py::repr(vllm_config)));
             py::object collector = py::cast(Collector{model_labels(vllm_config)});
             // telemetry_json of engine-core processes that end with os._exit: this process writes the path its own
             // configuration names (vLLM hands the engine core the same one), never one read from a segment.
             activekv::expect_descendant_telemetry_json(configured_telemetry_json(vllm_config));
             activekv::collect_ended_descendants_at_exit();
             py::object registry = registry_getter();
             try {
               registry.attr("register")(collector);
             } catch (py::error_already_set& e) {
               // DuplicateTimeseries (a ValueError): a collector of ours is registered already (a second AsyncLLM
               // in this process); it reads the same process tree.
               if (!e.matches(PyExc_ValueError)) throw;
             }
             return StatLogger{collector};
           }),
           py::arg("vllm_config"), py::arg("engine_indexes"), py::arg("registry_getter"))
      .def(
          "record",
          [](const StatLogger&, py::object, py::object, py::object, py::object) {}, py::arg("scheduler_stats"),
          py::arg("iteration_stats"), py::arg("mm_cache_stats") = py::none(), py::arg("engine_idx") = 0)
      .def("log_engine_initialized", [](const StatLogger&) {})
      .def_readonly("collector", &StatLogger::collector);
}
