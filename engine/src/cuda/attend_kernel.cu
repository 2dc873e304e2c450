// CUDA decode attention (cuda_kernel.h): split-K online softmax over blocks read in place, then a merge: per tile of
// one request row into the engine's online-softmax state, or for a step's whole decode batch into the output. ATen
// for tensors and streams only; no Python.
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

// Where head h's block j of a tile lies (its pool slot) and its position in the row: per head in device memory, or an
// exact tile's slots shared by every head in the launch's parameters (positions first_block + j).
struct HeadIndex {
  const int64_t* __restrict__ slots;
  const int64_t* __restrict__ pos;
  int n;
  __device__ __forceinline__ int64_t slot(int h, int j) const { return slots[static_cast<int64_t>(h) * n + j]; }
  __device__ __forceinline__ int64_t block_pos(int h, int j) const { return pos[static_cast<int64_t>(h) * n + j]; }
};
struct SharedIndex {
  CudaInlineIds slots;
  int64_t first_block;
  __device__ __forceinline__ int64_t slot(int, int j) const { return slots.v[j]; }
  __device__ __forceinline__ int64_t block_pos(int, int j) const { return first_block + j; }
};

// One CTA: one KV head, one split of the tile's blocks. L lanes hold one token's K/V row (D = L * kVec); the CTA's
// kThreads / L lane groups walk the split's tokens in lock step, each group with its own running state, combined
// through shared memory at the end into the split's partial (max, sum, accumulator) per query row.
// part: float32 [KVH, splits, rows, D + 2] = (m, l, acc[D]).
template <typename T, int L, typename Index>
__global__ void __launch_bounds__(kThreads) split_kernel(const T* __restrict__ pool, const Index index,
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
      const int64_t slot = index.slot(h, j);
      kpos = index.block_pos(h, j) * bs + o;
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

template <typename T, int L, typename Index>
void launch(const CudaAttendArgs& a, const T* pool, const Index& index, int64_t rows, int64_t splits,
            int64_t per_split, float* part, cudaStream_t stream) {
  constexpr int D = L * kVec;
  const int64_t kvh = a.pool.size(1), bs = a.pool.size(3);
  const size_t shared = static_cast<size_t>(kThreads / L) * rows * D * sizeof(float);
  split_kernel<T, L, Index><<<dim3(kvh, splits), kThreads, shared, stream>>>(
      pool, index, a.q.data_ptr<float>(), part, static_cast<int>(a.n), static_cast<int>(kvh), static_cast<int>(bs),
      static_cast<int>(rows), static_cast<int>(a.num_q), a.first_query_pos, static_cast<float>(a.scale),
      static_cast<int>(per_split));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int L>
void launch(const CudaAttendArgs& a, const T* pool, int64_t rows, int64_t splits, int64_t per_split, float* part,
            cudaStream_t stream) {
  if (a.host_slots == nullptr)
    return launch<T, L>(a, pool, HeadIndex{a.slots.data_ptr<int64_t>(), a.pos.data_ptr<int64_t>(),
                                           static_cast<int>(a.n)},
                        rows, splits, per_split, part, stream);
  SharedIndex index{};
  for (int64_t j = 0; j < a.n; ++j) index.slots.v[j] = static_cast<int32_t>(a.host_slots[j]);
  index.first_block = a.first_block;
  launch<T, L>(a, pool, index, rows, splits, per_split, part, stream);
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
  AKV_CHECK_VALUE(a.host_slots == nullptr || inline_ids_fit(a.host_slots, a.n, kCudaInlineIds),
                  "the CUDA kernel takes at most ", kCudaInlineIds, " slots in [0, 2^31) by value, got ", a.n);
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

// ---- the decode batch (cuda_kernel.h CudaBatchArgs): one launch for every exact decode row of a step ------------

constexpr int kBatchWarps = 4;
constexpr int kSub = 16;  // tokens of a sub-tile: the M of S = K Q^T and the K of O^T += V^T P^T

template <typename T>
struct MmaType;
template <>
struct MmaType<__nv_bfloat16> {
  static __device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  // (x, y) as one register, x in the low half; hi/lo: the value rounded to the type, and the rest rounded too.
  static __device__ __forceinline__ void split(float p, uint16_t& hi, uint16_t& lo) {
    const __nv_bfloat16 h = __float2bfloat16_rn(p);
    const __nv_bfloat16 l = __float2bfloat16_rn(p - __bfloat162float(h));
    hi = __bfloat16_as_ushort(h);
    lo = __bfloat16_as_ushort(l);
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct MmaType<__half> {
  static __device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ void split(float p, uint16_t& hi, uint16_t& lo) {
    const __half h = __float2half_rn(p);
    const __half l = __float2half_rn(p - __half2float(h));
    hi = __half_as_ushort(h);
    lo = __half_as_ushort(l);
  }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

__device__ __forceinline__ uint4 load16(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint32_t word(const uint4& u, int i) {
  return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}
__device__ __forceinline__ uint32_t pack(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// One CTA: work item blockIdx.x (sub-tiles [t0, t1) of one row), KV head blockIdx.y. Lane = 4 g + c (the mma
// fragments' groupID and thread-in-group). For S = K Q^T a sub-tile's token g and g + 8 are the A rows of lane (g, c)
// and query head g the B column; the head dimension is permuted (the sum over it does not care) so that lane (g, c)
// supplies, for its tokens, the 8 dims [32 j + 8 c, +8) of each of its D / 32 16-byte loads as the k-columns of two
// k-steps, and Q's fragment is loaded with the same permutation. The S fragment gives lane (g, c) tokens g, g + 8 of
// query heads 2c, 2c + 1, which is also where the O^T fragment keeps those heads: the online softmax is lane-local
// but for the max over the 16 tokens (three shuffles). For O^T += V^T P^T lane (g, c) loads tokens 2c, 2c+1, 2c+8,
// 2c+9 at dims [64 j + 8 g, +8) and pairs them with byte permutes into V^T's A fragment (output dims permuted the same
// way, undone when stored); P^T's B fragment comes from the lanes holding those tokens (shuffles).
// part_acc: float32 [items, kvh, group, D] accumulators; part_ml: float32 [items, kvh, group, 2] (max, sum).
template <typename T, int D>
__global__ void __launch_bounds__(kBatchWarps * 32)
    batch_split_kernel(const T* __restrict__ kv, const int32_t* __restrict__ page, const int32_t* __restrict__ arr,
                       int rows, int items, const T* __restrict__ query, int64_t qs0, int64_t qs1,
                       float* __restrict__ part_acc, float* __restrict__ part_ml, int kvh, int bs, int group,
                       float scale) {
  constexpr int JK = D / 32;  // 16-byte K loads per token and lane
  constexpr int JV = D / 64;  // 16-byte V loads per token and lane
  constexpr int MT = D / 16;  // O^T tiles of 16 dims
  const int item = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, c = lane & 3;
  const int4* rec = reinterpret_cast<const int4*>(arr + 4 * rows) + 2 * item;
  const int4 r0 = rec[0], r1 = rec[1];
  const int t0 = r0.x, t1 = r0.y, seq = r0.z, q0 = r0.w, first_block = r1.x;
  const int32_t* blocks = arr + 4 * rows + 8 * items;
  const int per_block = bs / kSub;
  const int b0 = t0 / per_block;

  __shared__ int64_t base[kCudaBatchMaxSplit + 1];  // element offset of (block, h)'s K run, per block of the item
  for (int i = threadIdx.x; i <= (t1 - 1) / per_block - b0; i += blockDim.x) {
    const int id = blocks[first_block + i];
    const int64_t slot = page != nullptr ? page[id] : id;
    base[i] = (slot * kvh + h) * 2 * static_cast<int64_t>(bs) * D;
  }
  // Q's B fragment, dims permuted as K's: per load j, words (0, 1) for k-step 2j and (2, 3) for 2j + 1.
  uint4 qf[JK];
#pragma unroll
  for (int j = 0; j < JK; ++j)
    qf[j] = g < group ? load16(query + q0 * qs0 + static_cast<int64_t>(h * group + g) * qs1 + j * 32 + c * 8)
                      : make_uint4(0, 0, 0, 0);
  __syncthreads();

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // query heads 2c, 2c + 1
  float acc[MT][4];
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
  const int tok[4] = {2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9};

  for (int u = t0 + warp; u < t1; u += kBatchWarps) {
    const T* kp = kv + base[u / per_block - b0] + static_cast<int64_t>(u % per_block) * kSub * D;
    const T* vp = kp + static_cast<int64_t>(bs) * D;
    uint4 kr[2][JK], vr[4][JV];
#pragma unroll
    for (int j = 0; j < JK; ++j) {
      kr[0][j] = load16(kp + g * D + j * 32 + c * 8);
      kr[1][j] = load16(kp + (g + 8) * D + j * 32 + c * 8);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < JV; ++j) vr[i][j] = load16(vp + tok[i] * D + j * 64 + g * 8);

    float s[4] = {0.f, 0.f, 0.f, 0.f};  // (token g, head 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1)
#pragma unroll
    for (int j = 0; j < JK; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        MmaType<T>::mma(s, word(kr[0][j], 2 * e), word(kr[1][j], 2 * e), word(kr[0][j], 2 * e + 1),
                        word(kr[1][j], 2 * e + 1), word(qf[j], 2 * e), word(qf[j], 2 * e + 1));

    // Causal limit: key positions >= seq (the unwritten tail of the last block, which may hold anything) are masked
    // by selection, and their V is taken as 0 so a zero probability never meets a non-finite value.
    const int pos = u * kSub + g;
    const bool see0 = pos < seq, see1 = pos + 8 < seq;
    float x[4] = {see0 ? s[0] * scale : -INFINITY, see0 ? s[1] * scale : -INFINITY,
                  see1 ? s[2] * scale : -INFINITY, see1 ? s[3] * scale : -INFINITY};
    if (u * kSub + kSub > seq) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (u * kSub + tok[i] >= seq)
#pragma unroll
          for (int j = 0; j < JV; ++j) vr[i][j] = make_uint4(0, 0, 0, 0);
    }
    float p[4];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      float mx = fmaxf(x[k], x[k + 2]);
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float mn = fmaxf(m[k], mx);  // finite: the sub-tile's first token is always seen
      const float a = expf(m[k] - mn);   // 0 on the first sub-tile (m = -inf)
      p[k] = expf(x[k] - mn);
      p[k + 2] = expf(x[k + 2] - mn);
      l[k] = l[k] * a + p[k] + p[k + 2];
      m[k] = mn;
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        acc[t][k] *= a;
        acc[t][k + 2] *= a;
      }
    }
    // P^T's B fragment of lane (g, c): head g's probabilities of tokens 2c, 2c+1 (b0) and 2c+8, 2c+9 (b1), held by
    // lanes (2c, g / 2) and (2c + 1, g / 2) as (token, token + 8) pairs of their heads 2 (g / 2) + {0, 1}.
    uint16_t hi[4], lo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) MmaType<T>::split(p[i], hi[i], lo[i]);
    const uint32_t h0 = pack(hi[0], hi[2]), h1 = pack(hi[1], hi[3]), l0 = pack(lo[0], lo[2]), l1 = pack(lo[1], lo[3]);
    const int src_a = 8 * c + (g >> 1), src_b = src_a + 4;
    const uint32_t ha0 = __shfl_sync(0xffffffffu, h0, src_a), ha1 = __shfl_sync(0xffffffffu, h1, src_a);
    const uint32_t hb0 = __shfl_sync(0xffffffffu, h0, src_b), hb1 = __shfl_sync(0xffffffffu, h1, src_b);
    const uint32_t la0 = __shfl_sync(0xffffffffu, l0, src_a), la1 = __shfl_sync(0xffffffffu, l1, src_a);
    const uint32_t lb0 = __shfl_sync(0xffffffffu, l0, src_b), lb1 = __shfl_sync(0xffffffffu, l1, src_b);
    const bool odd = g & 1;
    const uint32_t hx = odd ? ha1 : ha0, hy = odd ? hb1 : hb0, lx = odd ? la1 : la0, ly = odd ? lb1 : lb0;
    const uint32_t bh0 = __byte_perm(hx, hy, 0x5410), bh1 = __byte_perm(hx, hy, 0x7632);
    const uint32_t bl0 = __byte_perm(lx, ly, 0x5410), bl1 = __byte_perm(lx, ly, 0x7632);
#pragma unroll
    for (int j = 0; j < JV; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        // O^T tile (j, q): row g is dim 64 j + 8 g + 2q, row g + 8 the dim after it.
        const uint32_t w0 = word(vr[0][j], q), w1 = word(vr[1][j], q), w2 = word(vr[2][j], q),
                       w3 = word(vr[3][j], q);
        const uint32_t a0 = __byte_perm(w0, w1, 0x5410), a1 = __byte_perm(w0, w1, 0x7632);
        const uint32_t a2 = __byte_perm(w2, w3, 0x5410), a3 = __byte_perm(w2, w3, 0x7632);
        MmaType<T>::mma(acc[4 * j + q], a0, a1, a2, a3, bh0, bh1);
        MmaType<T>::mma(acc[4 * j + q], a0, a1, a2, a3, bl0, bl1);
      }
  }

  // The warp's sums over its 8 token lanes, then the four warps' states merged in shared memory.
#pragma unroll
  for (int k = 0; k < 2; ++k)
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) l[k] += __shfl_xor_sync(0xffffffffu, l[k], off);
  __shared__ float sm_m[kBatchWarps][8], sm_l[kBatchWarps][8];
  __shared__ float sm_acc[kBatchWarps][8][D];
  if (g == 0) {
    sm_m[warp][2 * c] = m[0];
    sm_m[warp][2 * c + 1] = m[1];
    sm_l[warp][2 * c] = l[0];
    sm_l[warp][2 * c + 1] = l[1];
  }
#pragma unroll
  for (int j = 0; j < JV; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int d = 64 * j + 8 * g + 2 * q;
      sm_acc[warp][2 * c][d] = acc[4 * j + q][0];
      sm_acc[warp][2 * c + 1][d] = acc[4 * j + q][1];
      sm_acc[warp][2 * c][d + 1] = acc[4 * j + q][2];
      sm_acc[warp][2 * c + 1][d + 1] = acc[4 * j + q][3];
    }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kBatchWarps; ++w) mx = fmaxf(mx, sm_m[w][r]);
    float ls = 0.f, as = 0.f;
#pragma unroll
    for (int w = 0; w < kBatchWarps; ++w) {
      const float wt = expf(sm_m[w][r] - mx);  // 0 for a warp that had no sub-tile (m = -inf)
      ls += sm_l[w][r] * wt;
      as += sm_acc[w][r][d] * wt;
    }
    const int64_t at = (static_cast<int64_t>(item) * kvh + h) * group + r;
    part_acc[at * D + d] = as;
    if (d == 0) {
      part_ml[2 * at] = mx;
      part_ml[2 * at + 1] = ls;
    }
  }
}

// One CTA per (batch row, KV head, query head): the row's partials merged, acc / sum written in the output dtype. The
// largest partial max and the rescaled sum first (threads over the items), then each warp sums every fourth item's
// accumulator (lanes over the head dimension, D / 32 values each, four items' loads in flight), and the warps' sums
// are added in shared memory in warp order: a fixed order, so the result is the same run to run.
template <typename T, int D>
__global__ void __launch_bounds__(128)
    batch_merge_kernel(const int32_t* __restrict__ arr, const float* __restrict__ part_acc,
                       const float* __restrict__ part_ml, T* __restrict__ out, int kvh, int group) {
  constexpr int V = D / 32;  // accumulator values per lane
  constexpr int kWarps = 4;
  const int r = blockIdx.x, h = blockIdx.y, qh = blockIdx.z;
  const int4 rec = reinterpret_cast<const int4*>(arr)[r];
  const int q0 = rec.x, i0 = rec.y, i1 = rec.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const auto at = [&](int i) { return (static_cast<int64_t>(i) * kvh + h) * group + qh; };
  __shared__ float sm_red[kWarps];
  __shared__ float sm_acc[kWarps][D];

  float mx = -INFINITY;
  for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) mx = fmaxf(mx, part_ml[2 * at(i)]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) sm_red[warp] = mx;
  __syncthreads();
  mx = fmaxf(fmaxf(sm_red[0], sm_red[1]), fmaxf(sm_red[2], sm_red[3]));
  __syncthreads();
  float ls = 0.f;
  for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) ls += part_ml[2 * at(i) + 1] * expf(part_ml[2 * at(i)] - mx);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, off);
  if (lane == 0) sm_red[warp] = ls;
  __syncthreads();
  ls = (sm_red[0] + sm_red[1]) + (sm_red[2] + sm_red[3]);

  float acc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = 0.f;
#pragma unroll 4
  for (int i = i0 + warp; i < i1; i += kWarps) {
    const float w = expf(part_ml[2 * at(i)] - mx);
    const float* src = part_acc + at(i) * D + lane * V;
    float x[V];
#pragma unroll
    for (int v = 0; v < V; v += 2) {
      const float2 f = *reinterpret_cast<const float2*>(src + v);
      x[v] = f.x;
      x[v + 1] = f.y;
    }
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = fmaf(x[v], w, acc[v]);
  }
#pragma unroll
  for (int v = 0; v < V; ++v) sm_acc[warp][lane * V + v] = acc[v];
  __syncthreads();
  T* dst = out + (static_cast<int64_t>(q0) * kvh * group + h * group + qh) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x)
    dst[d] = MmaType<T>::from_float(((sm_acc[0][d] + sm_acc[1][d]) + (sm_acc[2][d] + sm_acc[3][d])) / ls);
}

template <typename T, int D>
void launch_batch(const CudaBatchArgs& a, cudaStream_t stream) {
  const int kvh = static_cast<int>(a.kv.size(1)), bs = static_cast<int>(a.kv.size(3));
  const auto* kv = reinterpret_cast<const T*>(a.kv.data_ptr());
  const auto* query = reinterpret_cast<const T*>(a.query.data_ptr());
  auto* out = reinterpret_cast<T*>(a.out.data_ptr());
  const int32_t* arr = a.arrays.data_ptr<int32_t>();
  const int32_t* page = a.page.defined() ? a.page.data_ptr<int32_t>() : nullptr;
  float* part_acc = a.work.data_ptr<float>();
  float* part_ml = part_acc + a.items * kvh * a.group * D;
  const int group = static_cast<int>(a.group);
  batch_split_kernel<T, D><<<dim3(static_cast<unsigned>(a.items), kvh), kBatchWarps * 32, 0, stream>>>(
      kv, page, arr, static_cast<int>(a.rows), static_cast<int>(a.items), query, a.query.stride(0),
      a.query.stride(1), part_acc, part_ml, kvh, bs, group, static_cast<float>(a.scale));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  batch_merge_kernel<T, D><<<dim3(static_cast<unsigned>(a.rows), kvh, group), 128, 0, stream>>>(
      arr, part_acc, part_ml, out, kvh, group);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void batch_head(const CudaBatchArgs& a, cudaStream_t stream) {
  switch (a.kv.size(4)) {
    case 64: return launch_batch<T, 64>(a, stream);
    case 128: return launch_batch<T, 128>(a, stream);
    case 256: return launch_batch<T, 256>(a, stream);
    default: AKV_CHECK_VALUE(false, "the decode batch kernel supports head sizes 64, 128 and 256, got ",
                             a.kv.size(4));
  }
}

void decode_batch_cuda(const CudaBatchArgs& a) {
  const int64_t kvh = a.kv.size(1), d = a.kv.size(4);
  AKV_CHECK_VALUE(cuda_batch_supports(a.kv.scalar_type(), d, a.group, a.kv.size(3)),
                  "the decode batch kernel does not take ", a.kv.scalar_type(), " KV with head size ", d, ", ",
                  a.group, " query heads per KV head and block size ", a.kv.size(3));
  AKV_CHECK_VALUE(a.work.numel() >= a.items * kvh * a.group * (d + 2), "decode batch scratch too small");
  if (a.rows == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.kv.device().index()).stream();
  if (a.kv.scalar_type() == at::kBFloat16) return batch_head<__nv_bfloat16>(a, stream);
  return batch_head<__half>(a, stream);
}

int64_t multiprocessors(int64_t device_index) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, static_cast<int>(device_index)));
  return sms;
}

struct Registration {
  Registration() {
    register_cuda_attend(&attend_blocks_cuda);
    register_cuda_batch_kernel({&decode_batch_cuda, &multiprocessors});
  }
} registration;

}  // namespace
}  // namespace activekv
