// CUDA decode attention (cuda_kernel.h): split-K online softmax over pool blocks read in place, then a merge into
// the engine's online-softmax state. ATen for tensors and streams only; no Python.
#include <activekv/check.h>
#include <activekv/cuda_kernel.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

namespace activekv {
namespace {

constexpr int kThreads = 128;
constexpr int kVec = 8;  // K/V elements per lane per token (one 16-byte load for 16-bit types)
constexpr int kMaxRows = static_cast<int>(kCudaMaxRows);

__device__ __forceinline__ void load8(const float* p, float* out) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float* out) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void load8(const __half* p, float* out) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const auto* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// One CTA: one KV head, one split of the tile's blocks. L lanes hold one token's K/V row (D = L * kVec); the CTA's
// kThreads / L lane groups walk the split's tokens in lock step, each group with its own running state, combined
// through shared memory at the end into the split's partial (max, sum, accumulator) per query row.
// part: float32 [KVH, splits, rows, D + 2] = (m, l, acc[D]).
template <typename T, int L>
__global__ void __launch_bounds__(kThreads) split_kernel(const T* __restrict__ pool, const int64_t* __restrict__ slots,
                                                         const int64_t* __restrict__ pos,
                                                         const float* __restrict__ q, float* __restrict__ part,
                                                         int n, int kvh, int bs, int rows, int num_q,
                                                         int64_t first_query_pos, float scale,
                                                         int blocks_per_split) {
  constexpr int D = L * kVec;
  constexpr int G = kThreads / L;
  const int h = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  const int lane = threadIdx.x % L, group = threadIdx.x / L, d0 = lane * kVec;

  float qr[kMaxRows][kVec];
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r)
#pragma unroll
    for (int i = 0; i < kVec; ++i) qr[r][i] = r < rows ? q[(static_cast<int64_t>(h) * rows + r) * D + d0 + i] : 0.f;
  float m[kMaxRows], l[kMaxRows], acc[kMaxRows][kVec];
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[r][i] = 0.f;
  }

  const int b0 = split * blocks_per_split;
  const int b1 = min(n, b0 + blocks_per_split);
  const int tokens = (b1 - b0) * bs;
  // Every lane runs every iteration (the shuffles need the whole warp); groups past the end compute nothing.
  for (int base = 0; base < tokens; base += G) {
    const int t = base + group;
    const bool live = t < tokens;
    float k[kVec], v[kVec];
    int64_t kpos = 0;
    if (live) {
      const int j = b0 + t / bs, o = t % bs;
      const int64_t slot = slots[static_cast<int64_t>(h) * n + j];
      kpos = pos[static_cast<int64_t>(h) * n + j] * bs + o;
      const T* kp = pool + ((slot * kvh + h) * 2 * bs + o) * D + d0;  // K row; V is bs rows further
      load8(kp, k);
      load8(kp + static_cast<int64_t>(bs) * D, v);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) k[i] = v[i] = 0.f;
    }
    float s[kMaxRows];
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < kVec; ++i) dot = fmaf(qr[r][i], k[i], dot);
      s[r] = dot;
    }
#pragma unroll
    for (int off = L / 2; off > 0; off >>= 1)
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) s[r] += __shfl_xor_sync(0xffffffffu, s[r], off);
    if (!live) continue;
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r >= rows || kpos > first_query_pos + r % num_q) continue;  // causal mask
      const float sr = s[r] * scale;
      const float mn = fmaxf(m[r], sr);
      const float a = expf(m[r] - mn);  // 0 on the first key (m = -inf)
      const float p = expf(sr - mn);
      l[r] = l[r] * a + p;
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[r][i] = fmaf(p, v[i], acc[r][i] * a);
      m[r] = mn;
    }
  }

  __shared__ float sm_m[G][kMaxRows], sm_l[G][kMaxRows];
  extern __shared__ float sm_acc[];  // [G][rows][D]
  if (lane == 0)
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      sm_m[group][r] = m[r];
      sm_l[group][r] = l[r];
    }
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r)
    if (r < rows)
#pragma unroll
      for (int i = 0; i < kVec; ++i) sm_acc[(group * rows + r) * D + d0 + i] = acc[r][i];
  __syncthreads();
  for (int idx = threadIdx.x; idx < rows * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    float mx = -INFINITY;
    for (int g = 0; g < G; ++g) mx = fmaxf(mx, sm_m[g][r]);
    float ls = 0.f, as = 0.f;
    if (mx != -INFINITY) {
      for (int g = 0; g < G; ++g) {
        const float w = expf(sm_m[g][r] - mx);  // 0 for a group that saw no unmasked key
        ls += sm_l[g][r] * w;
        as += sm_acc[(g * rows + r) * D + d] * w;
      }
    }
    float* out = part + ((static_cast<int64_t>(h) * splits + split) * rows + r) * (D + 2);
    out[2 + d] = as;
    if (d == 0) {
      out[0] = mx;
      out[1] = ls;
    }
  }
}

// One CTA per (KV head, query row): fold the splits' partials into the running state (m, l, acc), in place.
__global__ void merge_kernel(const float* __restrict__ part, float* __restrict__ m, float* __restrict__ l,
                             float* __restrict__ acc, int splits, int rows, int d_size) {
  const int h = blockIdx.x, r = blockIdx.y;
  const int64_t row = static_cast<int64_t>(h) * rows + r;
  const float m_old = m[row];
  float mx = m_old;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, part[((static_cast<int64_t>(h) * splits + s) * rows + r) * (d_size + 2)]);
  if (mx == -INFINITY) return;  // nothing unmasked yet: the state stays as it is
  const float w_old = expf(m_old - mx);
  float ls = l[row] * w_old;
  for (int d = threadIdx.x; d < d_size; d += blockDim.x) {
    float a = acc[row * d_size + d] * w_old;
    for (int s = 0; s < splits; ++s) {
      const float* p = part + ((static_cast<int64_t>(h) * splits + s) * rows + r) * (d_size + 2);
      a = fmaf(p[2 + d], expf(p[0] - mx), a);
    }
    acc[row * d_size + d] = a;
  }
  __syncthreads();  // every thread has read m[row] and l[row] before they change
  if (threadIdx.x == 0) {
    for (int s = 0; s < splits; ++s) {
      const float* p = part + ((static_cast<int64_t>(h) * splits + s) * rows + r) * (d_size + 2);
      ls += p[1] * expf(p[0] - mx);
    }
    l[row] = ls;
    m[row] = mx;
  }
}

template <typename T, int L>
void launch(const CudaAttendArgs& a, const T* pool, int64_t rows, int64_t splits, int64_t per_split,
            float* part, cudaStream_t stream) {
  constexpr int D = L * kVec;
  const int64_t kvh = a.pool.size(1), bs = a.pool.size(3);
  const size_t shared = static_cast<size_t>(kThreads / L) * rows * D * sizeof(float);
  split_kernel<T, L><<<dim3(kvh, splits), kThreads, shared, stream>>>(
      pool, a.slots.data_ptr<int64_t>(), a.pos.data_ptr<int64_t>(), a.q.data_ptr<float>(), part,
      static_cast<int>(a.n), static_cast<int>(kvh), static_cast<int>(bs), static_cast<int>(rows),
      static_cast<int>(a.num_q), a.first_query_pos, static_cast<float>(a.scale), static_cast<int>(per_split));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void dispatch_head(const CudaAttendArgs& a, const T* pool, int64_t rows, int64_t splits, int64_t per_split,
                   float* part, cudaStream_t stream) {
  switch (a.pool.size(4)) {
    case 64: return launch<T, 8>(a, pool, rows, splits, per_split, part, stream);
    case 128: return launch<T, 16>(a, pool, rows, splits, per_split, part, stream);
    case 256: return launch<T, 32>(a, pool, rows, splits, per_split, part, stream);
    default: AKV_CHECK_VALUE(false, "the CUDA kernel supports head sizes 64, 128 and 256, got ", a.pool.size(4));
  }
}

void attend_blocks_cuda(const CudaAttendArgs& a) {
  const int64_t kvh = a.pool.size(1), d = a.pool.size(4), rows = a.q.size(1);
  AKV_CHECK_VALUE(cuda_kernel_supports(d, rows), "the CUDA kernel does not support head size ", d, " with ", rows,
                  " query rows per KV head");
  if (a.n == 0) return;
  // Splits: about two CTAs per multiprocessor over all KV heads, at least 4 blocks each.
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, a.pool.device().index()));
  const int64_t per_split = std::max<int64_t>(4, (a.n * kvh + 2 * sms - 1) / (2 * sms));
  const int64_t splits = (a.n + per_split - 1) / per_split;
  auto part = at::empty({kvh, splits, rows, d + 2}, a.q.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.pool.device().index()).stream();
  float* pp = part.data_ptr<float>();
  switch (a.pool.scalar_type()) {
    case at::kFloat: dispatch_head(a, a.pool.data_ptr<float>(), rows, splits, per_split, pp, stream); break;
    case at::kBFloat16:
      dispatch_head(a, reinterpret_cast<const __nv_bfloat16*>(a.pool.data_ptr<at::BFloat16>()), rows, splits,
                    per_split, pp, stream);
      break;
    case at::kHalf:
      dispatch_head(a, reinterpret_cast<const __half*>(a.pool.data_ptr<at::Half>()), rows, splits, per_split, pp,
                    stream);
      break;
    default: AKV_CHECK_TYPE(false, "the CUDA kernel supports float32, bfloat16 and float16, got ",
                            a.pool.scalar_type());
  }
  merge_kernel<<<dim3(kvh, rows), 128, 0, stream>>>(pp, a.m.data_ptr<float>(), a.l.data_ptr<float>(),
                                                    a.acc.data_ptr<float>(), static_cast<int>(splits),
                                                    static_cast<int>(rows), static_cast<int>(d));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

struct Registration {
  Registration() { register_cuda_attend(&attend_blocks_cuda); }
} registration;

}  // namespace
}  // namespace activekv
