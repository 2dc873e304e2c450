#pragma once
/// @file host_tier.h
/// @brief The host tier of a CUDA engine inside vLLM: vLLM's KV cache of ActiveKV's layers in page-locked host memory,
///        and the CUDA compute capabilities this build's engine runs on.
///
/// On CUDA, vLLM's KV cache of the layers ActiveKV serves is the engine's host tier (kv_state.h, tiered placement): one
/// backing buffer in pinned CPU memory, sized by vLLM's own KV-cache budget, viewed per layer by vLLM. The device
/// holds the model and the engine's active pools. The buffer is page-locked and mapped into the device's address
/// space (cudaHostAlloc with cudaHostAllocMapped | cudaHostAllocPortable); with unified virtual addressing its host
/// pointer is its device pointer, which copy_blocks_mapped (transfer.h) relies on. Exact size: no rounding, no cache.
///
/// The CUDA half (engine/src/cuda/host_tier.cu) is compiled only with the CUDA kernel (CMake, ACTIVEKV_CUDA) and
/// registers itself at load; without it, pinned_host_zeros falls back to torch's pinned-memory allocator (which rounds
/// sizes up to a power of two) and every capability is supported (the ATen path runs on any CUDA device).
#include <ATen/ATen.h>

#include <cstdint>

namespace activekv {

/// A zeroed int8 CPU tensor [nbytes] in page-locked host memory that the current CUDA device reads in place (the host
/// pointer is the device pointer), freed when its last reference goes.
/// @throws c10::ValueError for nbytes < 1; c10::Error (RuntimeError) when CUDA refuses the allocation (the message
///         names the size) or when this process has no CUDA.
at::Tensor pinned_host_zeros(int64_t nbytes);

/// Whether the engine runs on a CUDA device of compute capability major.minor: with this build's CUDA kernel, the
/// device must run the kernel's code (machine code or PTX for a capability <= the device's, as built); without it,
/// any capability (the ATen path).
bool cuda_capability_supported(int64_t major, int64_t minor);

/// The CUDA half's entry points, registered by its static initializer (null members in a build without it).
struct CudaHostTier {
  at::Tensor (*zeros)(int64_t nbytes) = nullptr;
  /// Lowest compute capability the CUDA kernel was built for, as 10 * major + minor (e.g. 90); 0 when unknown.
  int64_t min_capability = 0;
};
void register_cuda_host_tier(const CudaHostTier& tier);

}  // namespace activekv
