// Bindings that store a Python callable into state the per-step path reads (pybind11/functional.h wraps a Python
// callable in the std::function, silently): rejected at the binding. A callable only a non-step path reads is fine.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>

#include <functional>
#include <utility>

namespace py = pybind11;

namespace corpus_store {

struct Engine {
  std::function<void(int)> hook_;
  py::function on_evict_;
  py::object progress_;
  py::object http_handler_;

  void set_hook(std::function<void(int)> hook) { hook_ = std::move(hook); }
  int forward(int block) {
    if (hook_) hook_(block);
    if (on_evict_) on_evict_(block);  // expect: per-step-python-callback
    return progress_.is_none() ? block : block + 1;
  }
  int serve_http(int request) { return http_handler_.is_none() ? request : -request; }
};

struct Watcher {
  py::function cb_;
  explicit Watcher(py::function cb) : cb_(std::move(cb)) {}
  int build(int x) const { return cb_.is_none() ? x : 0; }
};

}  // namespace corpus_store

PYBIND11_MODULE(corpus_store, m) {
  using corpus_store::Engine;
  py::class_<Engine>(m, "Engine")
      .def(py::init<>())
      .def("set_hook", &Engine::set_hook)  // expect: per-step-python-callback
      .def("set_on_evict", [](Engine& e, py::function f) { e.on_evict_ = std::move(f); })  // expect: per-step-python-callback
      .def("set_http_handler", [](Engine& e, py::object h) { e.http_handler_ = std::move(h); })
      .def_readwrite("progress", &Engine::progress_)  // expect: per-step-python-callback
      .def("forward", &Engine::forward)
      .def("serve_http", &Engine::serve_http);
  py::class_<corpus_store::Watcher>(m, "Watcher")
      .def(py::init<py::function>())  // expect: per-step-python-callback
      .def("build", &corpus_store::Watcher::build);
}
