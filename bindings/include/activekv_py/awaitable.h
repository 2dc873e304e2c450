#pragma once
// The native awaitable of the _endpoint module: a coroutine written as a C++ state machine (a Job), exposed through
// CPython's async protocol (awaitable.cpp; how it works and the CPython source lines it relies on:
// docs/async-native.md). endpoint.cpp writes its Jobs; this header is all it sees of the protocol.
#include <pybind11/pybind11.h>

#include <memory>

namespace activekv::py_glue {

namespace py = pybind11;

/// What a Job asks for next: an awaitable to await (its result is passed to the next advance()), or, when
/// `awaitable` is null, the coroutine's return value.
struct Step {
  py::object awaitable;
  py::object result;
};

/// The body of a native coroutine. advance() runs with the GIL held: first with None, then with the result of each
/// awaitable it returned. A Python exception (py::error_already_set) or a C++ exception ends the coroutine with it.
class Job {
 public:
  virtual ~Job() = default;
  virtual Step advance(py::object last) = 0;
};

/// A new awaitable running `job` (register_awaitable must have run).
py::object make_awaitable(std::unique_ptr<Job> job);

/// Create the Awaitable type (a heap type, PyType_FromSpec) and publish it as m.Awaitable.
void register_awaitable(py::module_& m);

}  // namespace activekv::py_glue
