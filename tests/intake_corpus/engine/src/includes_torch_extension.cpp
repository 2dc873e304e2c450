// torch/extension.h drags Python in through torch's Python bindings: rejected in engine/.
#include <cstdint>
#include <torch/extension.h>  // expect: python-in-engine

namespace corpus_engine_extension {
int64_t twice(int64_t x) { return 2 * x; }
}  // namespace corpus_engine_extension
