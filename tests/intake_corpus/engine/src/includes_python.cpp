// The engine includes Python's C API header: rejected.
#include <Python.h>  // expect: python-in-engine
#include <vector>

namespace corpus_engine_python {
int size() { return static_cast<int>(std::vector<int>{1, 2}.size()); }
}  // namespace corpus_engine_python
