// A file that does not parse is a finding, never a silent pass.
#include <pybind11/pybind11.h>

namespace corpus_broken {
int ok() { return 1; }
int broken( { return 2; }  // expect: parse-error
}  // namespace corpus_broken
