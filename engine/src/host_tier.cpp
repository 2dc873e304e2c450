// The host tier's allocation and the CUDA capability answer (host_tier.h): compiled in every build; the CUDA half
// registers itself when it is built.
#include <activekv/check.h>
#include <activekv/host_tier.h>

namespace activekv {

namespace {
CudaHostTier& slot() {
  static CudaHostTier tier;
  return tier;
}
}  // namespace

void register_cuda_host_tier(const CudaHostTier& tier) { slot() = tier; }

at::Tensor pinned_host_zeros(int64_t nbytes) {
  AKV_CHECK_VALUE(nbytes >= 1, "the host tier must hold at least one byte, got ", nbytes);
  if (slot().zeros != nullptr) return slot().zeros(nbytes);
  // No CUDA half in this build: torch's pinned allocator (page-locked, mapped under UVA; sizes rounded up).
  return at::zeros({nbytes}, at::TensorOptions().dtype(at::kChar).pinned_memory(true));
}

bool cuda_capability_supported(int64_t major, int64_t minor) {
  AKV_CHECK_VALUE(major >= 0 && minor >= 0 && minor < 10, "a compute capability must be major.minor with minor in "
                  "[0, 10), got ", major, ".", minor);
  const int64_t min = slot().min_capability;
  return min == 0 || 10 * major + minor >= min;
}

}  // namespace activekv
