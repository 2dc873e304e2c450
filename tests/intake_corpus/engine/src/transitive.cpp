// Includes an engine header that includes pybind11: the header is the finding (corpus/leaky.h), not this file.
#include "corpus/leaky.h"

namespace corpus_engine_transitive {
int two() { return corpus_engine_leaky::one() + 1; }
}  // namespace corpus_engine_transitive
