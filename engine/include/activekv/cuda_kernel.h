#pragma once
/// @file cuda_kernel.h
/// @brief CUDA decode attention kernels: split-K online softmax over blocks read in place, GQA-aware. One kernel per
///        tile of one request row (any decode or short prefill row), and one launch for a whole step's decode batch.
///
/// Flash-decoding structure (Dao et al., "Flash-Decoding for long-context inference", 2023; the online softmax of
/// Milakov & Gimelshein, 2018): the blocks of one tile are split across CTAs per KV head; each CTA keeps a running
/// (max, sum, accumulator) for the group's query rows over its blocks, read straight from the pool's slots (no
/// gather); a second kernel merges the splits into the engine's online-softmax state, so tiles compose exactly as
/// the ATen path's do. Float32 math for float32/bfloat16/float16 K/V. No atomics and a fixed split for a given tile,
/// so results are identical run to run; they are not bit-identical to the ATen tile path (different summation
/// order): docs/parity.md states the tolerance, tests/test_gpu.py checks it.
///
/// Compiled only when torch has CUDA and a CUDA compiler is found (CMake, ACTIVEKV_CUDA); the engine asks
/// cuda_attend() and falls back to the ATen tile path when it is null or the shape is unsupported.
#include <ATen/ATen.h>

#include <climits>
#include <cstdint>
#include <vector>

namespace activekv {

/// Ids passed by value in a launch's parameters, so that a small tile's launch needs no index upload (a pinned buffer,
/// a host-to-device copy and a stream join per tile): up to kCudaInlineIds of them, each in [0, 2^31).
constexpr int64_t kCudaInlineIds = 256;
struct CudaInlineIds {
  int32_t v[kCudaInlineIds];
};
/// Whether ids[0, n) fit a CudaInlineIds, and at most `limit` of them (the caller's ACTIVEKV_INLINE_IDS).
inline bool inline_ids_fit(const int64_t* ids, int64_t n, int64_t limit) {
  if (n > limit || n > kCudaInlineIds) return false;
  for (int64_t j = 0; j < n; ++j)
    if (ids[j] < 0 || ids[j] > INT32_MAX) return false;
  return true;
}

/// One request row's tile on a CUDA device.
struct CudaAttendArgs {
  at::Tensor pool;   ///< [pool_blocks, num_kv_heads, 2, block_size, head_size], contiguous, CUDA
  at::Tensor slots;  ///< int64 [num_kv_heads * n] on the device: pool slot of head h's j-th block at [h * n + j]
  at::Tensor pos;    ///< int64 [num_kv_heads * n] on the device: that block's position in the row
  /// Instead of slots and pos, an exact tile's slots on the host (inline_ids_fit): every head reads block j from slot
  /// host_slots[j], at row position first_block + j, the slots passed in the launch's parameters
  const int64_t* host_slots = nullptr;
  int64_t first_block = 0;
  int64_t n = 0;     ///< blocks per KV head in this tile
  int64_t first_query_pos = 0;  ///< position of query token 0 (causal limit: key pos <= first_query_pos + i)
  int64_t num_q = 0;            ///< query tokens of the row; rows = group_size * num_q (row = g * num_q + i)
  at::Tensor q;      ///< float32 [num_kv_heads, rows, head_size], contiguous
  at::Tensor m;      ///< float32 [num_kv_heads, rows, 1] running max (in/out, updated in place)
  at::Tensor l;      ///< float32 [num_kv_heads, rows, 1] running sum (in/out)
  at::Tensor acc;    ///< float32 [num_kv_heads, rows, head_size] rescaled accumulator (in/out)
  double scale = 1.0;
};

using CudaAttendFn = void (*)(const CudaAttendArgs&);

/// The kernel's largest rows (group_size * num_q) and its head sizes; other shapes use the ATen path.
constexpr int64_t kCudaMaxRows = 8;
inline bool cuda_kernel_supports(int64_t head_size, int64_t rows) {
  return (head_size == 64 || head_size == 128 || head_size == 256) && rows >= 1 && rows <= kCudaMaxRows;
}

/// The registered CUDA kernel, or nullptr in a build without CUDA.
CudaAttendFn cuda_attend();
/// Called once by the CUDA object's static initializer.
void register_cuda_attend(CudaAttendFn fn);

/// The decode batch kernel: every exact decode row of a step (StepPlan::batch, one query token each) in one launch.
///
/// A work item is a run of 16-token sub-tiles of one row (the split of split-K); the grid is (work item, KV head) and
/// each CTA's four warps take its sub-tiles in turn, each warp reading a sub-tile's K and V once for the whole GQA
/// group (up to 8 query heads) with tensor-core products: S = K Q^T (bfloat16/float16 operands, float32 accumulation,
/// exact products), the online softmax in float32, then O^T += V^T P^T with P split into a high and a low part in the
/// KV dtype (two products: P is carried to about 2^-16 of itself, not rounded to the KV dtype), so the arithmetic is
/// float32's but for the order of additions. The warps' states merge in shared memory into one partial (max, sum,
/// accumulator) per (item, KV head, query head); a second kernel (one CTA per row, KV head and query head) merges a
/// row's partials and writes its output in the query dtype. No atomics and a split fixed by the plan: bit-identical
/// run to run.
///
/// DecodeBatch::arrays (int32, on the device), three sections one after the other:
///   rows  [rows][4]:   first query token, first work item, end of its work items, 0
///   items [items][8]:  first sub-tile, end sub-tile, context length, query token, index (in the blocks section) of
///                      the block holding the first sub-tile, 0, 0, 0
///   blocks [n]:        the rows' block ids, row after row
struct CudaBatchArgs {
  at::Tensor kv;      ///< [blocks, num_kv_heads, 2, block_size, head_size] contiguous, CUDA, bfloat16 or float16,
                      ///< 16-byte aligned: the host tier (in place) or the pool
  at::Tensor page;    ///< int32 [host_blocks] on the device, block id -> pool slot; undefined in place (slot = id)
  at::Tensor arrays;  ///< int32 on the device, laid out as above
  int64_t rows = 0, items = 0, blocks = 0;
  at::Tensor query;   ///< [>= tokens, num_heads, head_size], kv's dtype, head_size contiguous, rows 16-byte aligned
  at::Tensor out;     ///< [>= tokens, num_heads, head_size] contiguous, kv's dtype; the batch's rows are written
  at::Tensor work;    ///< float32 scratch of >= items * num_kv_heads * group * (head_size + 2) on the device: the
                      ///< work items' accumulators, then their (max, sum) pairs
  int64_t group = 1;  ///< query heads per KV head
  double scale = 1.0;
};

using CudaBatchFn = void (*)(const CudaBatchArgs&);

/// The shapes the decode batch kernel takes: bfloat16 or float16 KV, head size 64, 128 or 256, up to 8 query heads per
/// KV head, block sizes that are multiples of 16.
inline bool cuda_batch_supports(at::ScalarType dtype, int64_t head_size, int64_t group, int64_t block_size) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && (head_size == 64 || head_size == 128 || head_size == 256) &&
         group >= 1 && group <= 8 && block_size % 16 == 0;
}

/// 16-token sub-tiles of one work item: at most this many (a CTA keeps the item's block offsets in shared memory).
constexpr int64_t kCudaBatchMaxSplit = 64;

/// The registered decode batch kernel and the device query it plans with; null members in a build without CUDA.
struct CudaBatchKernel {
  CudaBatchFn attend = nullptr;
  int64_t (*multiprocessors)(int64_t device_index) = nullptr;  ///< streaming multiprocessors of a CUDA device
};
const CudaBatchKernel& cuda_batch_kernel();
void register_cuda_batch_kernel(const CudaBatchKernel& kernel);

/// The KV update on a CUDA device (kv_state.h KVState::write): every token of the slot mapping written, by two launches
/// on the current stream, into the host tier, the pool copy of its block where the block is resident, and the key
/// metadata of its block. No host synchronisation and no host loop: the slots are read on the device.
///
/// Launch 1, grid (token, KV head): K and V to the host tier at (slot / block_size, slot % block_size) and, where
/// page[block] >= 0, to that pool slot; a token at offset 0 resets its block's key min/max to +inf / -inf (vLLM fills a
/// fresh block from offset 0). Launch 2, same grid: each key folded into its block's min/max with a compare-and-swap
/// loop (NaN propagates, as scatter_reduce's amin/amax; of -0 and +0 and of two NaN payloads either may stay, as ATen
/// leaves them unspecified). Copies are exact, so the bytes equal the ATen ops' but for those ties.
///
/// A slot outside [-1, num_slots) writes nothing for its token and sets *error (the caller checked the slots before,
/// so this only guards against a slot mapping changed after its check).
struct CudaKvWriteArgs {
  at::Tensor host;          ///< [num_blocks, num_kv_heads, 2, block_size, head_size] any strides: device memory, or
                            ///< pinned host memory mapped into the device (host pointer = device pointer, UVA)
  at::Tensor pool;          ///< [pool_blocks, num_kv_heads, 2, block_size, head_size] contiguous on the device
  at::Tensor page;          ///< int32 [num_blocks] on the device, block -> pool slot or -1; undefined: no pool copies
  /// [num_blocks, num_kv_heads, head_size] contiguous on the device, the KV dtype; undefined in exact mode (no key
  /// metadata)
  at::Tensor key_min;
  at::Tensor key_max;       ///< same
  at::Tensor key, value;    ///< [>= n, num_kv_heads, head_size] any strides on the device, the KV dtype
  at::Tensor slot_mapping;  ///< int32 or int64 [n] on the device, any stride: slot of token i, -1 = padding
  int32_t* error = nullptr; ///< host-mapped flag set to 1 on a slot out of range (may be null)
};

using CudaKvWriteFn = void (*)(const CudaKvWriteArgs&);

/// The registered KV update kernel, or nullptr in a build without CUDA (KVState::write then uses ATen ops).
CudaKvWriteFn cuda_kv_write();
void register_cuda_kv_write(CudaKvWriteFn fn);

/// The row copy behind copy_blocks_mapped (transfer.h): rows of row_bytes copied from src to dst by one launch on the
/// device's current stream, row j of the batch read from src row src_ids[j] (or j) and written to dst row dst_ids[j]
/// (or j), exactly one of the two ids given (on the device, or for a few rows on the host: CudaInlineIds). Its two
/// uses, two kernels of one body: gather_kernel, the pinned host tier read through its device mapping (UVA) into a
/// contiguous device buffer; scatter_kernel, that buffer written into the pool's slots on the compute stream. 16-byte
/// loads, coalesced (consecutive threads read consecutive 16 bytes of a row), several loads in flight per thread before
/// its stores: a read from an SM crosses the bus at its latency, so the bus is filled only by many outstanding
/// requests. `ctas` CTAs take the rows' 16-byte words in a grid-stride loop; fewer CTAs leave more SMs to the compute
/// stream. Copies only: the bytes equal index_select's (gather) and index_copy_'s (scatter).
struct CudaGatherArgs {
  const void* src = nullptr;  ///< device-readable rows (device memory or mapped pinned host memory), 16-byte aligned
  at::Tensor src_ids;         ///< int64 [n] on the device, each a row of src (the caller checked them); undefined: j
  void* dst = nullptr;        ///< device rows, 16-byte aligned
  at::Tensor dst_ids;         ///< int64 [n] on the device, distinct rows of dst (the caller checked them); undefined: j
  /// Either id list on the host instead (inline_ids_fit), passed in the launch's parameters: no index upload
  const int64_t* host_src_ids = nullptr;
  const int64_t* host_dst_ids = nullptr;
  int64_t rows = 0;           ///< n, the rows copied
  int64_t row_bytes = 0;      ///< a multiple of 16
  int64_t ctas = 0;           ///< CTAs of the launch, >= 1
  int device = 0;             ///< the CUDA device whose current stream takes the launch
};

using CudaGatherFn = void (*)(const CudaGatherArgs&);

/// CTAs of the mapped gather unless ACTIVEKV_GATHER_CTAS says otherwise (transfer.cpp): a quarter of an H100/H200's
/// 132 SMs, many more requests in flight than the bus's bandwidth-delay product (tens of KiB at a few microseconds),
/// since an SM has only so many outstanding misses; tools/bench_gpu.py sweeps it.
constexpr int64_t kCudaGatherCtas = 32;
/// CTAs of the scatter from the gathered buffer into the pool (device memory on both sides, on the compute stream, the
/// stream's other work waiting on it): four 512-thread CTAs per SM of an H100/H200, every SM's share of HBM.
constexpr int64_t kCudaScatterCtas = 528;

/// The registered mapped gather, or nullptr in a build without CUDA (copy_blocks_mapped then uses index_select).
CudaGatherFn cuda_gather();
void register_cuda_gather(CudaGatherFn fn);

/// The copy engines' side of copy_blocks_mapped: contiguous runs of bytes from pinned host memory into device memory,
/// queued by one cudaMemcpyBatchAsync (CUDA 12.8 or later) on the current stream, in stream order, no SM used. A run
/// is a stretch of consecutive source blocks, so a tile whose blocks lie in order in the host tier is one copy.
struct CudaCopyRunsArgs {
  std::vector<void*> dst, src;  ///< run i: bytes[i] from src[i] (pinned host) to dst[i] (device)
  std::vector<size_t> bytes;
  int device = 0;  ///< the device whose current stream takes the copies
};

/// Queues the runs and returns true, or returns false without queuing anything where the copy engines cannot take
/// them on that stream (the legacy default stream, which cudaMemcpyBatchAsync refuses).
using CudaCopyRunsFn = bool (*)(CudaCopyRunsArgs&);

/// Mean bytes per run from which copy_blocks_mapped queues runs on the copy engines rather than its gather kernel,
/// unless ACTIVEKV_DMA_MIN_BYTES says otherwise (transfer.cpp): a copy engine takes a descriptor per run and nears
/// the bus only with long runs, while the gather kernel's 16-byte loads do not care how blocks are laid out. On the
/// H200 (tools/bench_gpu.py, 256 MiB of scattered blocks, the whole call): copy engines 3.8, 26.3, 42.4, 47.7 and
/// 49.6 GB/s at 16 KiB, 64 KiB, 256 KiB, 1 MiB and 4 MiB per run, the gather kernel 42.4 GB/s at 64 KiB, 45.1 at
/// 256 KiB, 45.6 at 1 MiB: the copy engines from 1 MiB.
constexpr int64_t kCudaDmaMinBytes = int64_t{1} << 20;

/// The registered copy-engine batch, or nullptr in a build without it (CUDA before 12.8, or no CUDA).
CudaCopyRunsFn cuda_copy_runs();
void register_cuda_copy_runs(CudaCopyRunsFn fn);

}  // namespace activekv
