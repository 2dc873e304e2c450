// pybind11 bindings that take a raw PyObject* (pybind11/type_caster_pyobject_ptr.h): keeping it in a static the
// per-step path calls is rejected at the binding and at the call; keeping one only a non-step binding calls, or using
// it during the call and keeping nothing, is accepted.
#include <pybind11/pybind11.h>
#include <pybind11/type_caster_pyobject_ptr.h>

namespace py = pybind11;

namespace corpus_pyobject_ptr {

PyObject* g_step_hook = nullptr;
PyObject* g_report = nullptr;

void set_step_hook(PyObject* fn) {
  Py_XINCREF(fn);
  Py_XDECREF(g_step_hook);
  g_step_hook = fn;
}

long step(long x) {
  PyObject* r = PyObject_CallFunctionObjArgs(g_step_hook, nullptr);  // expect: per-step-python-callback
  Py_XDECREF(r);
  return x + 1;
}

}  // namespace corpus_pyobject_ptr

PYBIND11_MODULE(corpus_pyobject_ptr, m) {
  using namespace corpus_pyobject_ptr;
  m.def("set_step_hook", &set_step_hook);  // expect: per-step-python-callback
  m.def("forward", &step);
  m.def("set_report", [](PyObject* fn) {
    Py_XINCREF(fn);
    Py_XDECREF(g_report);
    g_report = fn;
  });
  m.def("report", []() {
    PyObject* r = PyObject_CallNoArgs(g_report);
    Py_XDECREF(r);
  });
  m.def("length", [](PyObject* seq) { return PyObject_Length(seq); });
}
