// The KV update on a CUDA device (cuda_kernel.h CudaKvWriteArgs): new K/V written into the host tier (device memory,
// or pinned host memory through its device mapping), resident pool copies and key metadata by two launches on the
// current stream, the slots read on the device. ATen for tensors and streams only; no Python.
#include <activekv/check.h>
#include <activekv/cuda_kernel.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace activekv {
namespace {

// The KV dtypes by their bits: the copies move raw words, the metadata compares values.
enum class Kind { kFloat, kBFloat16, kHalf };

template <Kind K>
struct Bits;
template <>
struct Bits<Kind::kFloat> {
  using T = uint32_t;
  static constexpr uint32_t kPosInf = 0x7f800000u, kNegInf = 0xff800000u;
  __device__ static float value(uint32_t b) { return __uint_as_float(b); }
};
template <>
struct Bits<Kind::kBFloat16> {
  using T = uint16_t;
  static constexpr uint16_t kPosInf = 0x7f80u, kNegInf = 0xff80u;
  __device__ static float value(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
};
template <>
struct Bits<Kind::kHalf> {
  using T = uint16_t;
  static constexpr uint16_t kPosInf = 0x7c00u, kNegInf = 0xfc00u;
  __device__ static float value(uint16_t b) { return __half2float(__ushort_as_half(b)); }
};

struct Strides5 {
  int64_t s[5];
};
struct Strides3 {
  int64_t s[3];
};

// Launch 1, one CTA per (token, KV head): K and V to the host tier and the resident pool copy, and the reset of the
// block's key metadata at offset 0. A padding slot (-1) writes nothing; any other slot outside [0, num_slots) sets the
// error flag and writes nothing.
template <Kind K, typename I>
__global__ void kv_store_kernel(const I* __restrict__ slots, int64_t slot_stride, const typename Bits<K>::T* key,
                                Strides3 ks, const typename Bits<K>::T* value, Strides3 vs,
                                typename Bits<K>::T* host, Strides5 hs, typename Bits<K>::T* __restrict__ pool,
                                const int32_t* __restrict__ page, typename Bits<K>::T* __restrict__ key_min,
                                typename Bits<K>::T* __restrict__ key_max, int64_t num_slots, int bs, int kvh, int d,
                                int32_t* error) {
  using T = typename Bits<K>::T;
  const int64_t i = blockIdx.x;
  const int h = blockIdx.y;
  const int64_t s = static_cast<int64_t>(slots[i * slot_stride]);
  if (s == -1) return;
  if (s < 0 || s >= num_slots) {
    if (error != nullptr && h == 0 && threadIdx.x == 0) *reinterpret_cast<volatile int32_t*>(error) = 1;
    return;
  }
  const int64_t b = s / bs, o = s % bs;
  const int32_t p = page != nullptr ? page[b] : -1;
  const T* kp = key + i * ks.s[0] + h * ks.s[1];
  const T* vp = value + i * vs.s[0] + h * vs.s[1];
  T* hk = host + b * hs.s[0] + h * hs.s[1] + o * hs.s[3];
  T* hv = hk + hs.s[2];
  T* pk = p >= 0 ? pool + ((static_cast<int64_t>(p) * kvh + h) * 2 * bs + o) * d : nullptr;
  T* meta_min = key_min != nullptr ? key_min + (b * kvh + h) * d : nullptr;
  T* meta_max = key_max != nullptr ? key_max + (b * kvh + h) * d : nullptr;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    const T kj = kp[j * ks.s[2]], vj = vp[j * vs.s[2]];
    hk[j * hs.s[4]] = kj;
    hv[j * hs.s[4]] = vj;
    if (pk != nullptr) {
      pk[j] = kj;
      pk[static_cast<int64_t>(bs) * d + j] = vj;
    }
    if (o == 0 && meta_min != nullptr) {
      meta_min[j] = Bits<K>::kPosInf;
      meta_max[j] = Bits<K>::kNegInf;
    }
  }
}

// x replaces the value at `slot` when it is NaN or beyond it (lower for min, higher for max), unless that value is NaN:
// the order-independent min/max with NaN propagation of scatter_reduce's amin/amax. 16-bit values are swapped inside
// their aligned 32-bit word.
template <Kind K, bool kMin>
__device__ void fold_extreme(typename Bits<K>::T* slot, typename Bits<K>::T x) {
  using T = typename Bits<K>::T;
  const float xf = Bits<K>::value(x);
  const auto replaces = [xf](T cur_bits) {
    const float cur = Bits<K>::value(cur_bits);
    return (isnan(xf) || (kMin ? xf < cur : xf > cur)) && !isnan(cur);
  };
  if constexpr (sizeof(T) == 4) {
    auto* word = reinterpret_cast<unsigned int*>(slot);
    unsigned int old = *reinterpret_cast<volatile unsigned int*>(word);
    while (replaces(static_cast<T>(old))) {
      const unsigned int prev = atomicCAS(word, old, static_cast<unsigned int>(x));
      if (prev == old) return;
      old = prev;
    }
  } else {
    const auto addr = reinterpret_cast<uintptr_t>(slot);
    auto* word = reinterpret_cast<unsigned int*>(addr & ~uintptr_t{3});
    const unsigned int shift = (addr & 2u) != 0 ? 16u : 0u;
    unsigned int old = *reinterpret_cast<volatile unsigned int*>(word);
    while (replaces(static_cast<T>((old >> shift) & 0xffffu))) {
      const unsigned int next = (old & ~(0xffffu << shift)) | (static_cast<unsigned int>(x) << shift);
      const unsigned int prev = atomicCAS(word, old, next);
      if (prev == old) return;
      old = prev;
    }
  }
}

// Launch 2, same grid: every key folded into its block's min/max (after launch 1's resets, stream order).
template <Kind K, typename I>
__global__ void kv_meta_kernel(const I* __restrict__ slots, int64_t slot_stride, const typename Bits<K>::T* key,
                               Strides3 ks, typename Bits<K>::T* key_min, typename Bits<K>::T* key_max,
                               int64_t num_slots, int bs, int kvh, int d) {
  using T = typename Bits<K>::T;
  const int64_t i = blockIdx.x;
  const int h = blockIdx.y;
  const int64_t s = static_cast<int64_t>(slots[i * slot_stride]);
  if (s < 0 || s >= num_slots) return;
  const int64_t b = s / bs;
  const T* kp = key + i * ks.s[0] + h * ks.s[1];
  T* meta_min = key_min + (b * kvh + h) * d;
  T* meta_max = key_max + (b * kvh + h) * d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    const T kj = kp[j * ks.s[2]];
    fold_extreme<K, true>(meta_min + j, kj);
    fold_extreme<K, false>(meta_max + j, kj);
  }
}

template <int N>
auto strides_of(const at::Tensor& t) {
  std::conditional_t<N == 5, Strides5, Strides3> out{};
  for (int i = 0; i < N; ++i) out.s[i] = t.stride(i);
  return out;
}

template <Kind K, typename I>
void launch(const CudaKvWriteArgs& a, cudaStream_t stream) {
  using T = typename Bits<K>::T;
  const int64_t n = a.slot_mapping.size(0);
  const int kvh = static_cast<int>(a.host.size(1)), bs = static_cast<int>(a.host.size(3)),
            d = static_cast<int>(a.host.size(4));
  const int64_t num_slots = a.host.size(0) * bs;
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(kvh));
  const int threads = d >= 128 ? 128 : (d + 31) / 32 * 32;
  const auto* slots = a.slot_mapping.data_ptr<I>();
  const int64_t sstride = a.slot_mapping.stride(0);
  const auto* key = static_cast<const T*>(a.key.data_ptr());
  const auto* value = static_cast<const T*>(a.value.data_ptr());
  // Exact mode keeps no key metadata: the store skips its reset and launch 2 is not made.
  auto* kmin = a.key_min.defined() ? static_cast<T*>(a.key_min.data_ptr()) : nullptr;
  auto* kmax = a.key_max.defined() ? static_cast<T*>(a.key_max.data_ptr()) : nullptr;
  const int32_t* page = a.page.defined() && a.pool.size(0) > 0 ? a.page.data_ptr<int32_t>() : nullptr;
  kv_store_kernel<K, I><<<grid, threads, 0, stream>>>(
      slots, sstride, key, strides_of<3>(a.key), value, strides_of<3>(a.value), static_cast<T*>(a.host.data_ptr()),
      strides_of<5>(a.host), page != nullptr ? static_cast<T*>(a.pool.data_ptr()) : nullptr, page, kmin, kmax,
      num_slots, bs, kvh, d, a.error);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (kmin == nullptr) return;
  kv_meta_kernel<K, I><<<grid, threads, 0, stream>>>(slots, sstride, key, strides_of<3>(a.key), kmin, kmax, num_slots,
                                                     bs, kvh, d);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <Kind K>
void launch_kind(const CudaKvWriteArgs& a, cudaStream_t stream) {
  if (a.slot_mapping.scalar_type() == at::kInt) {
    launch<K, int32_t>(a, stream);
  } else {
    launch<K, int64_t>(a, stream);
  }
}

void kv_write_cuda(const CudaKvWriteArgs& a) {
  // The caller (KVState::write) validated shapes, dtypes and devices; these guard the kernel's own assumptions.
  TORCH_INTERNAL_ASSERT(a.host.dim() == 5 && a.key.dim() == 3 && a.value.dim() == 3 && a.slot_mapping.dim() == 1,
                        "kv_write_cuda: unexpected ranks");
  TORCH_INTERNAL_ASSERT(a.slot_mapping.is_cuda() && a.key.is_cuda() && a.value.is_cuda() &&
                            a.key_min.defined() == a.key_max.defined() &&
                            (!a.key_min.defined() || (a.key_min.is_cuda() && a.key_min.is_contiguous() &&
                                                      a.key_max.is_contiguous())) &&
                            (!a.page.defined() || a.pool.is_contiguous()),
                        "kv_write_cuda: unexpected devices or layouts");
  const int64_t n = a.slot_mapping.size(0);
  if (n == 0) return;
  TORCH_INTERNAL_ASSERT(n <= 0x7fffffff && a.key.size(0) >= n, "kv_write_cuda: ", n, " tokens");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.key.device().index()).stream();
  switch (a.key.scalar_type()) {
    case at::kFloat: launch_kind<Kind::kFloat>(a, stream); break;
    case at::kBFloat16: launch_kind<Kind::kBFloat16>(a, stream); break;
    case at::kHalf: launch_kind<Kind::kHalf>(a, stream); break;
    default: TORCH_INTERNAL_ASSERT(false, "kv_write_cuda: dtype ", a.key.scalar_type());
  }
}

struct Registration {
  Registration() { register_cuda_kv_write(&kv_write_cuda); }
} registration;

}  // namespace
}  // namespace activekv
