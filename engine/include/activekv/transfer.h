#pragma once
/// @file transfer.h
/// @brief Host <-> device transfers: batched block copies between the host tier and the active pool.
///
/// One gather (`index_select`) and one scatter (`index_copy_`) per batch of blocks, whatever the block count, so the
/// cost is two ATen ops rather than one copy per block (small scattered copies are the transfer problem: one copy per
/// 16 KiB block reaches about 2% of a PCIe/C2C bus). On CPU these are plain memory copies.
///
/// Tiered (host tier in pinned CPU memory, pool on a CUDA device): copy_blocks_staged gathers the blocks on the CPU
/// into one pinned staging buffer, copies it host-to-device on a dedicated copy stream, records an event there and
/// makes the compute stream wait on it before the scatter into the pool. Ordering rules this gives:
///  - attention reads a block only after the copy that admitted it (the event);
///  - a pool slot is overwritten only on the compute stream, so never before earlier attention on it has run (no
///    write-after-read on a reused slot);
///  - the device staging buffer is recorded on the compute stream, so the caching allocator does not hand it out
///    again before the scatter has read it; the pinned staging buffer is held by the caching host allocator until
///    the copy that reads it has completed (ATen records that event on non-blocking copies from pinned memory);
///  - one copy per batch, never one per block, so the copy stream's queue stays short.
/// Everything here is device-generic c10 (Stream, Event, VirtualGuardImpl): the same source builds with or without
/// CUDA, and the staged path is only taken when a CUDA device is present at run time.
#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <vector>

namespace activekv {

/// A block-id list as an int64 tensor [n] on `device` (the index argument of every gather and scatter). On a CUDA
/// device the list goes through pinned memory with a non-blocking copy, so building an index never synchronizes.
at::Tensor index_tensor(const std::vector<int64_t>& ids, at::Device device);

/// The same index for the current stream, its host-to-device copy queued on `upload` (a tiered engine's copy stream;
/// nullptr: on the current stream), which the current stream then waits for. Host-to-device copies of two streams
/// share the copy engines, and a small index copy on the compute stream waits behind every tile copy the copy stream
/// has queued (in an H200 trace of streamed decode, a step's attention kernels ran only after its last tile copy), so
/// a tiered engine's per-tile indexes go on the copy stream, each right after its own tile.
at::Tensor index_tensor(const std::vector<int64_t>& ids, at::Device device, const c10::Stream* upload);

/// Copy blocks `src[src_ids[i]] -> dst[dst_ids[i]]` along dim 0, on the current stream (synchronous on CPU).
/// @param src [num_src_blocks, ...] (e.g. the host tier [num_blocks, num_kv_heads, 2, block_size, head_size])
/// @param dst [num_dst_blocks, ...] same trailing shape and dtype (e.g. the pool)
/// @param src_ids, dst_ids equal-length block indices, in range for src and dst; dst_ids distinct
/// @return bytes copied
/// @throws c10::ValueError on mismatched shapes or lengths, a repeated dst id, a meta tensor or a dst that requires
///         grad; c10::TypeError on mismatched dtypes; c10::IndexError on an out-of-range id.
int64_t copy_blocks(const at::Tensor& src, const at::Tensor& dst, const std::vector<int64_t>& src_ids,
                    const std::vector<int64_t>& dst_ids);

/// copy_blocks from a pinned CPU `src` to a CUDA `dst` through `copy_stream` (see the file comment for the ordering).
/// Returns once the work is queued; the compute stream (the device's current stream) is ordered after the copy.
/// @param copy_stream a stream of dst's device other than the current one
/// @throws as copy_blocks; c10::ValueError if src is not pinned CPU memory or dst is not on copy_stream's device.
int64_t copy_blocks_staged(const at::Tensor& src, const at::Tensor& dst, const std::vector<int64_t>& src_ids,
                           const std::vector<int64_t>& dst_ids, const c10::Stream& copy_stream);

/// copy_blocks from a pinned CPU `src` to a CUDA `dst` read straight from host memory over the bus, into a device
/// buffer on `copy_stream`; the compute stream waits on an event and scatters into dst (the row copy's scatter kernel
/// where a block is a multiple of 16 bytes, else index_copy_). No CPU gather and no pinned staging. Same ordering
/// rules as copy_blocks_staged. Two ways to read, chosen per call by how the blocks lie in src:
///  - where the batch's runs of consecutive source blocks average at least mapped_dma_min_bytes() (a tile whose blocks
///    lie in order in the host tier is one run), the copy engines: one cudaMemcpyBatchAsync of the runs
///    (cuda_kernel.h CudaCopyRunsArgs), no SM used;
///  - otherwise the gather kernel: with unified virtual addressing a pinned host pointer is valid in device code, so
///    one kernel reads the scattered blocks through the mapping (cuda_kernel.h CudaGatherArgs: 16-byte loads,
///    mapped_gather_ctas() CTAs) when the build has it and a block is a multiple of 16 bytes at a 16-byte aligned src;
///    else index_select over the mapping (8-byte words when a block is a multiple of 8 bytes, else bytes).
/// Either way the bytes are src's. A batch of at most inline_ids_limit() blocks (a small tile's) passes its ids to the
/// gather and scatter kernels in their launch parameters, with no index upload (index_select still takes one).
/// @throws as copy_blocks_staged; c10::ValueError if src or dst is not contiguous.
int64_t copy_blocks_mapped(const at::Tensor& src, const at::Tensor& dst, const std::vector<int64_t>& src_ids,
                           const std::vector<int64_t>& dst_ids, const c10::Stream& copy_stream);

/// copy_blocks_mapped without its shape, dtype, placement and id checks (contiguity is still checked), for the engine's
/// admission: src is the bound host tier (checked pinned when bound), dst the layer's pool, the ids admission's own (in
/// range, each destination once). Those checks cost host time on every admitted tile (is_pinned asks the driver).
int64_t copy_blocks_mapped_unchecked(const at::Tensor& src, const at::Tensor& dst, const std::vector<int64_t>& src_ids,
                                     const std::vector<int64_t>& dst_ids, const c10::Stream& copy_stream);

/// CTAs the next copy_blocks_mapped gather kernel launches: ACTIVEKV_GATHER_CTAS (1..1024, read at each call) or
/// cuda_kernel.h's kCudaGatherCtas; 0 in a build without the CUDA gather kernel (copy_blocks_mapped uses index_select).
int64_t mapped_gather_ctas();

/// Mean bytes per run of consecutive source blocks from which the next copy_blocks_mapped uses the copy engines:
/// ACTIVEKV_DMA_MIN_BYTES (0 .. 2^50, read at each call: 0 always, 2^50 never) or cuda_kernel.h's kCudaDmaMinBytes;
/// -1 in a build without the copy-engine batch (CUDA before 12.8, or no CUDA).
int64_t mapped_dma_min_bytes();

/// Most block ids a CUDA launch takes by value (cuda_kernel.h CudaInlineIds) rather than from an uploaded index:
/// ACTIVEKV_INLINE_IDS (0 .. kCudaInlineIds, read at each call: 0 uploads every index) or kCudaInlineIds.
int64_t inline_ids_limit();

}  // namespace activekv
