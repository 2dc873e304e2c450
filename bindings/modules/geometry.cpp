// activekv._geometry: context geometry and the frozen KV-cache layout (engine/include/activekv/geometry.h).
#include <activekv/geometry.h>
#include <activekv_py/common.h>

namespace py = pybind11;
using activekv::Geometry;

PYBIND11_MODULE(_geometry, m) {
  m.doc() = "ActiveKV context geometry. KV-cache layout: [num_blocks, num_kv_heads, 2, block_size, head_size].";
  activekv::py_glue::register_exceptions(m);
  py::class_<Geometry>(m, "Geometry", "Shape of one model's attention KV; raises ValueError/TypeError if invalid.")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, at::ScalarType, int64_t>(), py::arg("num_layers"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_size"), py::arg("block_size"),
           py::arg("dtype"), py::arg("tile_blocks") = 1)
      .def_readonly("num_layers", &Geometry::num_layers)
      .def_readonly("num_heads", &Geometry::num_heads)
      .def_readonly("num_kv_heads", &Geometry::num_kv_heads)
      .def_readonly("head_size", &Geometry::head_size)
      .def_readonly("block_size", &Geometry::block_size)
      .def_readonly("dtype", &Geometry::dtype)
      .def_readonly("tile_blocks", &Geometry::tile_blocks)
      .def_property_readonly("group_size", &Geometry::group_size, "Query heads per KV head (GQA group).")
      .def_property_readonly("tile_tokens", &Geometry::tile_tokens, "Tokens per tile.")
      .def("slot_to_block", &Geometry::slot_to_block, py::arg("slot"),
           "(block, offset) of a slot; IndexError for a negative slot.")
      .def("blocks_for", &Geometry::blocks_for, py::arg("length"), "ceil(length / block_size).")
      .def("elements_per_block", &Geometry::elements_per_block, "Elements of one block (K and V, all KV heads).")
      .def("bytes_per_block", &Geometry::bytes_per_block, "Bytes of one block (K and V, all KV heads).")
      .def("kv_cache_shape", &Geometry::kv_cache_shape, py::arg("num_blocks"),
           "[num_blocks, num_kv_heads, 2, block_size, head_size].")
      .def("vllm_cache_shape", &Geometry::vllm_cache_shape, py::arg("num_blocks"),
           "vLLM's LBHNC per-layer view: [num_blocks, num_kv_heads, block_size, 2 * head_size].");
  m.def("as_block_layout", &activekv::as_block_layout, py::arg("geometry"), py::arg("kv_cache"),
        py::arg("name") = "kv_cache",
        "View a contiguous per-layer KV cache ([nb, kvh, 2, bs, d] or [nb, kvh, bs, 2d]) as [nb, kvh, 2, bs, d].");
  m.def("supported_dtypes", &activekv::supported_dtypes, "KV dtypes the engine accepts.");
  m.def("supported_head_sizes", &activekv::supported_head_sizes, "Head sizes the vLLM backend declares.");
  m.def("supported_block_sizes", &activekv::supported_block_sizes, "Block sizes the vLLM backend declares.");
}
