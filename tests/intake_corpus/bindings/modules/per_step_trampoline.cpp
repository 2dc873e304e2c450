// A Python subclass of a native interface: the per-step path calls the virtual method, the trampoline calls Python.
#include <pybind11/pybind11.h>

#include <memory>

namespace py = pybind11;

namespace corpus_trampoline {

struct Policy {
  virtual ~Policy() = default;
  virtual int score(int block) const = 0;
};

struct PyPolicy : Policy {
  int score(int block) const override {
    PYBIND11_OVERRIDE_PURE(int, Policy, score, block);  // expect: per-step-python-callback
  }
};

struct Admission {
  std::shared_ptr<Policy> policy;
  int forward(int block) const { return policy ? policy->score(block) : 0; }
};

}  // namespace corpus_trampoline

PYBIND11_MODULE(corpus_trampoline, m) {
  using corpus_trampoline::Admission;
  using corpus_trampoline::Policy;
  py::class_<Policy, corpus_trampoline::PyPolicy, std::shared_ptr<Policy>>(m, "Policy")
      .def(py::init<>())
      .def("score", &Policy::score);
  py::class_<Admission>(m, "Admission")
      .def(py::init<>())
      .def_readwrite("policy", &Admission::policy)
      .def("forward", &Admission::forward);
}
