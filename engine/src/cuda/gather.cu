// The row copy (cuda_kernel.h CudaGatherArgs): blocks read by id from pinned host memory through its device mapping
// into a contiguous device buffer, or from that buffer into the pool's slots, one launch on the current stream, the
// ids in device memory or (a tile's few) in the launch's parameters; and the copy engines' side (CudaCopyRunsArgs):
// runs of blocks queued by one cudaMemcpyBatchAsync. ATen for tensors and streams only; no Python.
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

// Where row j's ids come from: device memory, the launch's parameters, or j itself.
struct DeviceIds {
  const int64_t* __restrict__ p;
  __device__ __forceinline__ int64_t operator[](int64_t j) const { return p[j]; }
};
struct ParamIds {
  CudaInlineIds ids;
  __device__ __forceinline__ int64_t operator[](int64_t j) const { return ids.v[j]; }
};
struct OwnIds {
  __device__ __forceinline__ int64_t operator[](int64_t j) const { return j; }
};

// The rows as 16-byte words: word i of the batch is word i % row_words of batch row j = i / row_words, read from src
// row src_ids[j] and written to dst row dst_ids[j]. A CTA takes tiles of kThreads * kUnroll consecutive words, thread
// t words t, t + kThreads, ...: consecutive threads read consecutive words of a row (a tile may span rows). A thread
// first finds its words' ids, then issues all its loads, then stores: the loads (over the bus, for the mapped gather)
// overlap one another, and no load waits on another's id.
template <typename SrcIds, typename DstIds>
__device__ __forceinline__ void copy_rows(const uint4* __restrict__ src, const SrcIds& src_ids,
                                          uint4* __restrict__ dst, const DstIds& dst_ids, int64_t row_words,
                                          int64_t total) {
  constexpr int64_t kTile = static_cast<int64_t>(kThreads) * kUnroll;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kTile + threadIdx.x; base < total;
       base += static_cast<int64_t>(gridDim.x) * kTile) {
    int64_t from[kUnroll], to[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + static_cast<int64_t>(k) * kThreads;
      const int64_t row = i / row_words, word = i - row * row_words;
      from[k] = i < total ? src_ids[row] * row_words + word : -1;
      to[k] = i < total ? dst_ids[row] * row_words + word : -1;
    }
    uint4 w[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) w[k] = from[k] >= 0 ? src[from[k]] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (to[k] >= 0) dst[to[k]] = w[k];
    }
  }
}

// Two kernels of one body, so that a profile tells the read over the bus from the scatter in device memory.
template <typename SrcIds>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(const uint4* __restrict__ src, const SrcIds src_ids, uint4* __restrict__ dst, int64_t row_words,
                  int64_t total) {
  copy_rows(src, src_ids, dst, OwnIds{}, row_words, total);
}

template <typename DstIds>
__global__ void __launch_bounds__(kThreads)
    scatter_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, const DstIds dst_ids, int64_t row_words,
                   int64_t total) {
  copy_rows(src, OwnIds{}, dst, dst_ids, row_words, total);
}

const int64_t* ids_or_null(const at::Tensor& ids, int64_t n) {
  if (!ids.defined()) return nullptr;
  TORCH_INTERNAL_ASSERT(ids.is_cuda() && ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.size(0) == n &&
                            ids.is_contiguous(),
                        "gather_cuda: ids must be ", n, " contiguous int64 on the device");
  return ids.data_ptr<int64_t>();
}

ParamIds param_ids(const int64_t* host, int64_t n) {
  TORCH_INTERNAL_ASSERT(inline_ids_fit(host, n, kCudaInlineIds), "gather_cuda: ", n,
                        " host ids do not fit the launch's parameters");
  ParamIds p{};
  for (int64_t j = 0; j < n; ++j) p.ids.v[j] = static_cast<int32_t>(host[j]);
  return p;
}

void gather_cuda(const CudaGatherArgs& a) {
  // The caller (transfer.cpp) checked the ids and chose this path for aligned rows; these guard the kernel's own
  // assumptions.
  TORCH_INTERNAL_ASSERT(a.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(a.src) % 16 == 0 &&
                            reinterpret_cast<uintptr_t>(a.dst) % 16 == 0 && a.ctas >= 1 && a.rows >= 0,
                        "gather_cuda: rows not 16-byte aligned, or ", a.ctas, " CTAs, or ", a.rows, " rows");
  const int64_t* src_ids = ids_or_null(a.src_ids, a.rows);
  const int64_t* dst_ids = ids_or_null(a.dst_ids, a.rows);
  const bool by_src = src_ids != nullptr || a.host_src_ids != nullptr;
  const bool by_dst = dst_ids != nullptr || a.host_dst_ids != nullptr;
  TORCH_INTERNAL_ASSERT(by_src != by_dst && (src_ids == nullptr || a.host_src_ids == nullptr) &&
                            (dst_ids == nullptr || a.host_dst_ids == nullptr),
                        "gather_cuda: src_ids or dst_ids, one of them, on the device or on the host");
  const int64_t row_words = a.row_bytes / 16;
  if (a.rows == 0 || row_words == 0) return;
  const int64_t total = a.rows * row_words;
  constexpr int64_t kTile = static_cast<int64_t>(kThreads) * kUnroll;
  // No more CTAs than tiles: a CTA past the last tile would only return.
  const auto ctas = static_cast<unsigned>(std::min(a.ctas, (total + kTile - 1) / kTile));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(a.device)).stream();
  const auto* from = static_cast<const uint4*>(a.src);
  auto* to = static_cast<uint4*>(a.dst);
  if (src_ids != nullptr) {
    gather_kernel<<<ctas, kThreads, 0, stream>>>(from, DeviceIds{src_ids}, to, row_words, total);
  } else if (a.host_src_ids != nullptr) {
    gather_kernel<<<ctas, kThreads, 0, stream>>>(from, param_ids(a.host_src_ids, a.rows), to, row_words, total);
  } else if (dst_ids != nullptr) {
    scatter_kernel<<<ctas, kThreads, 0, stream>>>(from, to, DeviceIds{dst_ids}, row_words, total);
  } else {
    scatter_kernel<<<ctas, kThreads, 0, stream>>>(from, to, param_ids(a.host_dst_ids, a.rows), row_words, total);
  }
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
