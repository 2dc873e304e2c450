// A module that binds vLLM's endpoint-plugin contract (attach_router, init_state) serves HTTP requests: every Python
// call in it is reported, whether a binding reaches it or only a type slot does (PyIter_Send included), so that each
// one is a reviewed baseline entry. The same calls in a module without those bindings are accepted.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace corpus_request {

struct Plugin {
  int routes = 0;
};

// Reached from no binding: an ASGI awaitable's am_send slot.
PySendResult drive(PyObject* inner, PyObject** out) {
  return PyIter_Send(inner, Py_None, out);  // expect: request-path-python-call
}

py::object respond(py::object send) {
  py::dict start;
  start["type"] = "http.response.start";  // building a dict calls nothing: accepted
  return send(start);  // expect: request-path-python-call
}

}  // namespace corpus_request

PYBIND11_MODULE(corpus_request, m) {
  py::class_<corpus_request::Plugin>(m, "Plugin")
      .def(py::init<>())
      .def("attach_router",
           [](corpus_request::Plugin& p, py::object app) {
             app.attr("add_route")("/v1/x", py::none());  // expect: request-path-python-call
             ++p.routes;
           })
      .def("init_state", [](corpus_request::Plugin& p, py::object client) { return p.routes; })
      .def("respond", [](corpus_request::Plugin&, py::object send) { return corpus_request::respond(send); });
}
