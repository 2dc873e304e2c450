// Plain engine code: accepted. Mentions of Python in comments and strings never count:
// #include <Python.h>, PyImport_ImportModule("os"), pybind11::module_::import("os").
#include <string>

namespace corpus_engine_clean {
std::string describe() { return "no #include <Python.h> and no PyRun_SimpleString(\"x\") here"; }
}  // namespace corpus_engine_clean
