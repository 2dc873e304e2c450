// activekv._kv_state: the two tiers, the page table and per-block key metadata (engine/include/activekv/kv_state.h).
#include <activekv/kv_state.h>
#include <activekv_py/common.h>

#include <memory>
#include <mutex>

namespace py = pybind11;

namespace {
// A KVState with its own (unregistered) telemetry, for exercising the KV-state part on its own. Every method runs
// under `mu` (the writers without the GIL), so calls from several Python threads never interleave; accessors hand
// out copies, never the state's own tensors.
struct PyKVState {
  PyKVState(int64_t num_layers, int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size,
            at::ScalarType dtype, int64_t pool_blocks, at::Device device, bool key_metadata)
      : state(activekv::Geometry(num_layers, num_heads, num_kv_heads, head_size, block_size, dtype, 1), pool_blocks,
              device, key_metadata),
        telemetry(false) {}
  activekv::KVState state;
  activekv::Telemetry telemetry;
  mutable std::mutex mu;
};

// A copy of a tensor of the state, taken under the lock (undefined stays undefined: None in Python).
at::Tensor copy_of(const PyKVState& s, at::Tensor activekv::LayerState::*member, int64_t layer) {
  std::lock_guard<std::mutex> lock(s.mu);
  const at::Tensor& t = s.state.layer(layer).*member;
  return t.defined() ? t.clone() : t;
}
}  // namespace

PYBIND11_MODULE(_kv_state, m) {
  m.doc() = "ActiveKV key-value state: host tier (referenced), active pool (owned), page table, key min/max.";
  activekv::py_glue::register_exceptions(m);
  py::class_<PyKVState>(m, "KVState", "Host tier + active pool of every layer, keyed by vLLM physical block id.")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, at::ScalarType, int64_t, at::Device, bool>(),
           py::arg("num_layers"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_size"),
           py::arg("block_size"), py::arg("dtype"), py::arg("pool_blocks"), py::arg("device") = at::Device("cpu"),
           py::arg("key_metadata") = true,
           "key_metadata: keep per-block key min/max (compressed mode's; an exact engine keeps none).")
      .def(
          "bind_host",
          [](PyKVState& s, int64_t layer, const at::Tensor& kv_cache) {
            std::lock_guard<std::mutex> lock(s.mu);
            auto host = s.state.host_view(kv_cache);
            s.state.bind_host(layer, host, s.telemetry);
            return host;
          },
          py::arg("layer"), py::arg("kv_cache"), py::call_guard<py::gil_scoped_release>(),
          "Bind the layer's host tier; returns it as [num_blocks, num_kv_heads, 2, block_size, head_size].")
      .def(
          "write",
          [](PyKVState& s, int64_t layer, const at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
             const at::Tensor& slot_mapping) {
            std::lock_guard<std::mutex> lock(s.mu);
            s.state.write(layer, s.state.host_view(kv_cache), key, value, slot_mapping, s.telemetry);
          },
          py::arg("layer"), py::arg("kv_cache"), py::arg("key"), py::arg("value"), py::arg("slot_mapping"),
          py::call_guard<py::gil_scoped_release>(),
          "Write key/value [T, KVH, D] at slot_mapping [n <= T] (-1 = padding): host tier, write-through, metadata.")
      .def(
          "resident",
          [](const PyKVState& s, int64_t layer) {
            std::lock_guard<std::mutex> lock(s.mu);
            return activekv::py_glue::resident_dict(s.state.layer(layer));
          },
          py::arg("layer"), "{block id: pool slot} of the layer's resident blocks.")
      .def("pool", [](const PyKVState& s, int64_t layer) { return copy_of(s, &activekv::LayerState::pool, layer); },
           py::arg("layer"), py::call_guard<py::gil_scoped_release>(),
           "A copy of the layer's pool [pool_blocks, num_kv_heads, 2, block_size, head_size].")
      .def("key_min",
           [](const PyKVState& s, int64_t layer) { return copy_of(s, &activekv::LayerState::key_min, layer); },
           py::arg("layer"), py::call_guard<py::gil_scoped_release>(),
           "A copy of the per-dimension key minimum per block [num_blocks, num_kv_heads, head_size] in the KV dtype; "
           "None before the layer's first bind, or without key_metadata.")
      .def("key_max",
           [](const PyKVState& s, int64_t layer) { return copy_of(s, &activekv::LayerState::key_max, layer); },
           py::arg("layer"), py::call_guard<py::gil_scoped_release>(),
           "A copy of the per-dimension key maximum per block [num_blocks, num_kv_heads, head_size] in the KV dtype; "
           "None before the layer's first bind, or without key_metadata.")
      .def(
          "reset_layer",
          [](PyKVState& s, int64_t layer) {
            std::lock_guard<std::mutex> lock(s.mu);
            s.state.reset_layer(layer);
          },
          py::arg("layer"), py::call_guard<py::gil_scoped_release>(), "Forget every resident block of the layer.")
      .def(
          "counters",
          [](const PyKVState& s) {
            std::lock_guard<std::mutex> lock(s.mu);
            return activekv::py_glue::snapshot_to_dict(s.telemetry.snapshot());
          },
          "Telemetry of this KV state (tokens_written, padding_slots, write_through_tokens, host_rebinds, ...).");
}
