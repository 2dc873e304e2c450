#pragma once
// Private to engine/src/: integer environment overrides the engine reads for measurement (ACTIVEKV_CUDA_SPLIT,
// ACTIVEKV_GATHER_CTAS, ACTIVEKV_DMA_MIN_BYTES, ACTIVEKV_INLINE_IDS), read at each use so that a benchmark can sweep
// them.
#include <cstdint>
#include <cstdlib>

namespace activekv {

/// The variable's value when it is an integer in [lo, hi], else `fallback` (unset, not an integer, or out of range).
inline int64_t env_int(const char* name, int64_t lo, int64_t hi, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  return end != v && *end == '\0' && x >= lo && x <= hi ? x : fallback;
}

}  // namespace activekv
