// The mapped gather (cuda_kernel.h CudaGatherArgs): blocks read by id from pinned host memory through its device
// mapping into a contiguous device buffer, one launch on the current stream; and its copy-engine side
// (CudaCopyRunsArgs): runs of blocks queued by one cudaMemcpyBatchAsync. ATen for tensors and streams only; no Python.
#include <activekv/cuda_kernel.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace activekv {
namespace {

constexpr int kThreads = 512;
// 16-byte loads each thread has in flight before its first store: 8 per thread, 64 KiB per CTA.
constexpr int kUnroll = 8;

// The rows as 16-byte words: word i of the output is word i % row_words of row ids[i / row_words]. A CTA takes tiles
// of kThreads * kUnroll consecutive words, thread t words t, t + kThreads, ...: consecutive threads read consecutive
// words of a row (a tile may span rows). A thread first loads its words' ids (device memory), then issues all its
// host loads, then stores: the loads over the bus overlap one another, and no bus read waits on another's id.
__global__ void __launch_bounds__(kThreads)
    gather_kernel(const uint4* __restrict__ src, const int64_t* __restrict__ ids, uint4* __restrict__ dst,
                  int64_t row_words, int64_t total) {
  constexpr int64_t kTile = static_cast<int64_t>(kThreads) * kUnroll;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kTile + threadIdx.x; base < total;
       base += static_cast<int64_t>(gridDim.x) * kTile) {
    int64_t at[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + static_cast<int64_t>(k) * kThreads;
      const int64_t row = i / row_words;
      at[k] = i < total ? ids[row] * row_words + (i - row * row_words) : -1;
    }
    uint4 w[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) w[k] = at[k] >= 0 ? src[at[k]] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (at[k] >= 0) dst[base + static_cast<int64_t>(k) * kThreads] = w[k];
    }
  }
}

void gather_cuda(const CudaGatherArgs& a) {
  // The caller (copy_blocks_mapped) checked the ids and chose this path for aligned rows; these guard the kernel's
  // own assumptions.
  TORCH_INTERNAL_ASSERT(a.ids.is_cuda() && a.ids.scalar_type() == at::kLong && a.ids.dim() == 1 &&
                            a.dst.is_cuda() && a.dst.is_contiguous() && a.dst.dim() == 2 &&
                            a.dst.size(0) == a.ids.size(0) && a.dst.size(1) * a.dst.element_size() == a.row_bytes,
                        "gather_cuda: unexpected ids or dst");
  TORCH_INTERNAL_ASSERT(a.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(a.src) % 16 == 0 &&
                            reinterpret_cast<uintptr_t>(a.dst.data_ptr()) % 16 == 0 && a.ctas >= 1,
                        "gather_cuda: rows not 16-byte aligned, or ", a.ctas, " CTAs");
  const int64_t n = a.ids.size(0), row_words = a.row_bytes / 16;
  if (n == 0 || row_words == 0) return;
  const int64_t total = n * row_words;
  constexpr int64_t kTile = static_cast<int64_t>(kThreads) * kUnroll;
  // No more CTAs than tiles: a CTA past the last tile would only return.
  const auto ctas = static_cast<unsigned>(std::min(a.ctas, (total + kTile - 1) / kTile));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.dst.device().index()).stream();
  gather_kernel<<<ctas, kThreads, 0, stream>>>(static_cast<const uint4*>(a.src), a.ids.data_ptr<int64_t>(),
                                               static_cast<uint4*>(a.dst.data_ptr()), row_words, total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#if CUDART_VERSION >= 12080
bool copy_runs_cuda(CudaCopyRunsArgs& a) {
  TORCH_INTERNAL_ASSERT(a.dst.size() == a.src.size() && a.bytes.size() == a.src.size(), "copy_runs_cuda: ",
                        a.dst.size(), " destinations, ", a.src.size(), " sources, ", a.bytes.size(), " sizes");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(a.device)).stream();
  if (stream == nullptr) return false;  // the legacy default stream: cudaMemcpyBatchAsync refuses it
  if (a.src.empty()) return true;
  // Stream order: a run is read after the work queued before it on this stream (among it the copy stream's wait for
  // the KV update that wrote the host tier), as cudaMemcpyAsync would read it.
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaMemcpyBatchAsync(a.dst.data(), a.src.data(), a.bytes.data(), a.src.size(), &attr, &attr_index,
                                      1, stream));
#else
  size_t failed = 0;
  C10_CUDA_CHECK(cudaMemcpyBatchAsync(a.dst.data(), a.src.data(), a.bytes.data(), a.src.size(), &attr, &attr_index,
                                      1, &failed, stream));
#endif
  return true;
}
#endif

struct Registration {
  Registration() {
    register_cuda_gather(&gather_cuda);
#if CUDART_VERSION >= 12080
    register_cuda_copy_runs(&copy_runs_cuda);
#endif
  }
} registration;

}  // namespace
}  // namespace activekv
