// pybind11's ways to import or run Python from C++: each is rejected, through aliases and macros too.
#include <pybind11/eval.h>
#include <pybind11/pybind11.h>

namespace py = pybind11;
namespace q = pybind11;  // a second namespace alias
#define LOAD(name) q::module_::import(name)

namespace corpus_pybind11 {

using pybind11::module_;

void imports() {
  py::module_ a = py::module_::import("json");  // expect: python-import-from-cpp
  py::module_ b = py::module::import("os");  // expect: python-import-from-cpp
  py::module_ c = module_::import("sys");  // expect: python-import-from-cpp
  py::module_ d = LOAD("math");  // expect: python-import-from-cpp
  py::module_ e = LOAD_FROM_FLAGS("re");  // expect: python-import-from-cpp
  a.reload();  // expect: python-import-from-cpp
  (void)b, (void)c, (void)d, (void)e;
}

void runs(py::object scope) {
  py::object x = py::eval("1 + 1", scope);  // expect: python-import-from-cpp
  py::exec("y = 2", scope);  // expect: python-import-from-cpp
  q::eval_file("script.py", scope);  // expect: python-import-from-cpp
  (void)x;
}

// In a comment: py::module_::import("os"), py::exec("x"), LOAD("os"). In a string: accepted.
const char* kHelp = "call py::module_::import(\"os\") or py::exec(\"x\") from Python, never from C++";

}  // namespace corpus_pybind11
