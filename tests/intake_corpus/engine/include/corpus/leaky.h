#pragma once
// An engine header that includes a pybind11 header: rejected (parsed with the engine target's flags).
#include <pybind11/pybind11.h>  // expect: python-in-engine

namespace corpus_engine_leaky {
inline int one() { return 1; }
}  // namespace corpus_engine_leaky
