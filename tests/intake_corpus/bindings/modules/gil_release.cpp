// Per-step bindings that take tensors and release the GIL around native compute: accepted.
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace corpus_gil {
at::Tensor scale(const at::Tensor& x, double s) { return x.mul(s); }
}  // namespace corpus_gil

PYBIND11_MODULE(corpus_gil, m) {
  m.def("forward", &corpus_gil::scale, py::arg("x"), py::arg("s"), py::call_guard<py::gil_scoped_release>(),
        "x [T, D] times s -> [T, D].");
  m.def(
      "build",
      [](const at::Tensor& q, const at::Tensor& k) {
        py::gil_scoped_release release;
        return q.matmul(k.t());
      },
      py::arg("q"), py::arg("k"), "q [T, D] @ k [S, D]^T -> [T, S].");
}
