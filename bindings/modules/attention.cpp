// activekv._attention: online-softmax tiled attention (engine/include/activekv/attention.h).
#include <activekv/attention.h>
#include <activekv_py/common.h>

namespace py = pybind11;

PYBIND11_MODULE(_attention, m) {
  m.doc() = "ActiveKV tiled attention: online softmax over tiles of blocks, GQA, causal prefill chunks and decode.";
  activekv::py_glue::register_exceptions(m);
  m.def("tiled_attention", &activekv::tiled_attention, py::arg("q"), py::arg("kv"), py::arg("seq_len"),
        py::arg("tile_blocks"), py::arg("scale"), py::call_guard<py::gil_scoped_release>(),
        "q [Lq, H, D], kv [nb, KVH, 2, bs, D] -> float32 [Lq, H, D]; the last Lq of seq_len positions attend "
        "causally.");
  m.def("group_query", &activekv::group_query, py::arg("q"), py::arg("num_kv_heads"),
        py::call_guard<py::gil_scoped_release>(), "[Lq, H, D] -> float32 [KVH, G * Lq, D].");
  m.def("ungroup_output", &activekv::ungroup_output, py::arg("out"), py::arg("num_q_tokens"),
        py::call_guard<py::gil_scoped_release>(), "[KVH, G * Lq, D] -> [Lq, H, D].");
  m.def(
      "tile_mask",
      [](int64_t first_query_pos, int64_t num_q_tokens, int64_t key_start, int64_t num_keys) {
        return activekv::tile_mask(first_query_pos, num_q_tokens, key_start, num_keys, at::kCPU);
      },
      py::arg("first_query_pos"), py::arg("num_q_tokens"), py::arg("key_start"), py::arg("num_keys"),
      py::call_guard<py::gil_scoped_release>(), "bool [Lq, num_keys], True where key_pos > query_pos (masked).");
}
