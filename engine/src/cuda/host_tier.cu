// The CUDA half of host_tier.h: the host tier in page-locked, device-mapped host memory, and the capabilities the CUDA
// kernel was built for. Registered at load (host_tier.cpp holds the registry).
#include <activekv/check.h>
#include <activekv/host_tier.h>

#include <ATen/Parallel.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace activekv {
namespace {

at::Tensor cuda_pinned_host_zeros(int64_t nbytes) {
  void* host = nullptr;
  const cudaError_t err =
      cudaHostAlloc(&host, static_cast<size_t>(nbytes), cudaHostAllocMapped | cudaHostAllocPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();  // reset the runtime's last error, so a later call does not report this one
    TORCH_CHECK(false, "cannot allocate ActiveKV's host tier: cudaHostAlloc of ", nbytes, " bytes of pinned host "
                "memory failed (", cudaGetErrorString(err), "); lower vLLM's kv_cache_memory_bytes");
  }
  // copy_blocks_mapped reads the host tier through its host pointer in device code: that needs the device pointer of
  // the mapping to be the host pointer (unified virtual addressing, every 64-bit Linux CUDA device).
  void* dev = nullptr;
  const cudaError_t map_err = cudaHostGetDevicePointer(&dev, host, 0);
  if (map_err != cudaSuccess || dev != host) {
    cudaFreeHost(host);
    TORCH_CHECK(false, "ActiveKV's host tier needs unified virtual addressing (a mapped pinned buffer whose device "
                "pointer is its host pointer), got ", map_err == cudaSuccess ? "a different device pointer"
                                                                           : cudaGetErrorString(map_err));
  }
  // Zeroed as vLLM's own torch.zeros KV cache is, in parallel chunks (page-locked memory is already resident).
  auto* bytes = static_cast<char*>(host);
  constexpr int64_t kChunk = int64_t{64} << 20;
  at::parallel_for(0, (nbytes + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t off = c * kChunk;
      std::memset(bytes + off, 0, static_cast<size_t>(std::min(kChunk, nbytes - off)));
    }
  });
  return at::from_blob(host, {nbytes}, [](void* p) { cudaFreeHost(p); }, at::TensorOptions().dtype(at::kChar));
}

// nvcc's __CUDA_ARCH_LIST__ (host code too): the architectures this file is compiled for, e.g. 900 or 800,900; the
// engine's CUDA kernel is built with the same CMAKE_CUDA_ARCHITECTURES, machine code plus PTX of each.
constexpr int64_t lowest_arch() {
#ifdef __CUDA_ARCH_LIST__
  constexpr int64_t archs[] = {__CUDA_ARCH_LIST__};
  int64_t low = archs[0];
  for (int64_t a : archs) low = a < low ? a : low;
  return low / 10;  // 900 -> 90
#else
  return 0;
#endif
}

struct Registration {
  Registration() { register_cuda_host_tier(CudaHostTier{&cuda_pinned_host_zeros, lowest_arch()}); }
} registration;

}  // namespace
}  // namespace activekv
