#pragma once
// A binding header with no compile_commands.json entry: parsed with the flags of a file of its target
// (bindings/), so LOAD_FROM_FLAGS, which only those flags define, resolves.
#include <pybind11/pybind11.h>

namespace corpus_glue {
inline pybind11::object numpy() { return LOAD_FROM_FLAGS("numpy"); }  // expect: python-import-from-cpp
}  // namespace corpus_glue
