// activekv._transfer: batched block copies between tiers (engine/include/activekv/transfer.h).
#include <activekv/transfer.h>
#include <activekv_py/common.h>

namespace py = pybind11;

PYBIND11_MODULE(_transfer, m) {
  m.doc() = "ActiveKV host <-> device transfers: batched block copies along dim 0.";
  activekv::py_glue::register_exceptions(m);
  m.def("copy_blocks", &activekv::copy_blocks, py::arg("src"), py::arg("dst"), py::arg("src_ids"), py::arg("dst_ids"),
        py::call_guard<py::gil_scoped_release>(),
        "dst[dst_ids[i]] = src[src_ids[i]] for every i, in one gather and one scatter; returns bytes copied.");
}
