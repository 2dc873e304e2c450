// Per-step entry points (bindings named build, forward, do_kv_cache_update, update_block_table, ...) must reach no
// Python call, however many native functions lie between; other bindings may call Python.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace corpus_step {

struct Runner {
  int steps = 0;
};

int calls_python(py::object fn) {
  return fn(1).cast<int>();  // expect: per-step-python-callback
}

int indirect(py::object fn) { return calls_python(fn) + 1; }

int native_helper(int x) { return x + 1; }

PyObject* c_api_call(PyObject* fn) {
  return PyObject_CallNoArgs(fn);  // expect: per-step-python-callback
}

int configure_only(py::function f) { return f(2).cast<int>(); }  // reached from no per-step binding: accepted

}  // namespace corpus_step

PYBIND11_MODULE(corpus_step, m) {
  py::class_<corpus_step::Runner>(m, "Runner")
      .def(py::init<>())
      .def("forward",
           [](corpus_step::Runner& r, py::object fn) {
             r.steps += corpus_step::indirect(fn);
             return r.steps;
           })
      .def("build",
           [](corpus_step::Runner& r, py::object cm) {
             py::object causal = cm.attr("causal");  // reading an attribute calls nothing: accepted
             return corpus_step::native_helper(r.steps) + static_cast<int>(causal.cast<bool>());
           })
      .def("configure", [](corpus_step::Runner&, py::function f) { return corpus_step::configure_only(f); });
  m.def("do_kv_cache_update", [](py::handle fn) {
    PyObject* out = corpus_step::c_api_call(fn.ptr());
    Py_XDECREF(out);
  });
  m.def("update_block_table", [](py::object table) {
    return table.attr("clone")();  // expect: per-step-python-callback
  });
}
