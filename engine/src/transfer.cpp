// Transfers (transfer.h): batched block copies between the host tier and the pool (plain, mapped and staged) and
// the index tensors they take.
#include <activekv/check.h>
#include <activekv/cuda_kernel.h>
#include <activekv/geometry.h>
#include <activekv/transfer.h>

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <utility>

#include "env_int.h"

namespace activekv {

namespace {

void check_copy(const at::Tensor& src, const at::Tensor& dst, const std::vector<int64_t>& src_ids,
                const std::vector<int64_t>& dst_ids) {
  AKV_CHECK_VALUE(src.dim() >= 1 && dst.dim() == src.dim() && src.sizes().slice(1) == dst.sizes().slice(1),
                  "src and dst must share their trailing block shape, got src ", shape_str(src.sizes()), " and dst ",
                  shape_str(dst.sizes()));
  AKV_CHECK_TYPE(src.scalar_type() == dst.scalar_type(), "src and dst must share a dtype, got ", src.scalar_type(),
                 " and ", dst.scalar_type());
  check_has_data(src, "src");
  check_writable(dst, "dst");
  AKV_CHECK_VALUE(src_ids.size() == dst_ids.size(), "src_ids and dst_ids must have equal lengths, got ",
                  src_ids.size(), " and ", dst_ids.size());
  // A bitmap of dst's blocks: dst.size(0) / 8 bytes zeroed and one bit test per id (a hash set of the batch costs an
  // allocation per id: at 16384 ids it was most of a checked call's host time).
  std::vector<uint64_t> written((static_cast<size_t>(dst.size(0)) + 63) / 64, 0);
  for (size_t i = 0; i < src_ids.size(); ++i) {
    AKV_CHECK_INDEX(src_ids[i] >= 0 && src_ids[i] < src.size(0), "src_ids[", i, "] must be in [0, ", src.size(0),
                    "), got ", src_ids[i]);
    AKV_CHECK_INDEX(dst_ids[i] >= 0 && dst_ids[i] < dst.size(0), "dst_ids[", i, "] must be in [0, ", dst.size(0),
                    "), got ", dst_ids[i]);
    // Two copies into one block would leave which one lands unspecified (neither index_copy_ nor the scatter kernel
    // orders them).
    uint64_t& word = written[static_cast<size_t>(dst_ids[i]) / 64];
    const uint64_t bit = uint64_t{1} << (dst_ids[i] % 64);
    AKV_CHECK_VALUE((word & bit) == 0, "dst_ids[", i, "] = ", dst_ids[i], " repeats an earlier destination block");
    word |= bit;
  }
}

// The current stream of `device` waits for the work queued on `from` so far, and `tensors` (allocated on `from`) are
// recorded on it, so the caching allocator reuses their memory only after the current stream's use.
void join_current(const c10::Stream& from, at::Device device, std::initializer_list<at::Tensor> tensors) {
  c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream current = impl.getStream(device);
  c10::Event done(device.type());
  done.record(from);
  done.block(current);
  for (const auto& t : tensors)
    if (t.defined()) impl.recordDataPtrOnStream(t.storage().data_ptr(), current);
}

int64_t batch_bytes(const at::Tensor& src, size_t n) {
  return static_cast<int64_t>(n) * (src.numel() / std::max<int64_t>(src.size(0), 1)) *
         static_cast<int64_t>(src.element_size());
}

}  // namespace

at::Tensor index_tensor(const std::vector<int64_t>& ids, at::Device device) {
  const bool to_device = !device.is_cpu();
  auto t = at::empty({static_cast<int64_t>(ids.size())}, at::TensorOptions().dtype(at::kLong).pinned_memory(to_device));
  std::copy(ids.begin(), ids.end(), t.data_ptr<int64_t>());
  return to_device ? t.to(device, /*non_blocking=*/true) : t;
}

at::Tensor index_tensor(const std::vector<int64_t>& ids, at::Device device, const c10::Stream* upload) {
  if (upload == nullptr || device.is_cpu()) return index_tensor(ids, device);
  at::Tensor dev;
  {
    c10::StreamGuard guard(*upload);
    dev = index_tensor(ids, device);
  }
  join_current(*upload, device, {dev});
  return dev;
}

int64_t copy_blocks(const at::Tensor& src, const at::Tensor& dst, const std::vector<int64_t>& src_ids,
                    const std::vector<int64_t>& dst_ids) {
  check_copy(src, dst, src_ids, dst_ids);
  if (src_ids.empty()) return 0;
  // One gather and one scatter for the whole batch: two ATen ops whatever the block count.
  auto gathered = src.index_select(0, index_tensor(src_ids, src.device()));
  dst.index_copy_(0, index_tensor(dst_ids, dst.device()), gathered.to(dst.device()));
  return batch_bytes(src, src_ids.size());
}

namespace {
void check_tiered(const at::Tensor& src, const at::Tensor& dst, const c10::Stream& copy_stream) {
  AKV_CHECK_VALUE(src.is_cpu() && src.is_pinned(), "src must be pinned CPU memory, got ", src.device(),
                  src.is_cpu() ? " (pageable)" : "");
  AKV_CHECK_VALUE(dst.device().is_cuda() && dst.device() == copy_stream.device(),
                  "dst must be on the copy stream's CUDA device ", copy_stream.device(), ", got ", dst.device());
}

// The row copy kernel (cuda_kernel.h CudaGatherArgs) takes rows of 16-byte words at 16-byte aligned addresses.
bool row_copy_fits(const void* src, const void* dst, int64_t row_bytes) {
  return cuda_gather() != nullptr && row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(dst) % 16 == 0;
}

// Called on the compute stream (the current one, outside any guard of the copy stream): it waits for the copy stream's
// work so far; `buffer` (allocated on the copy stream) and `dst_ids` (a device index queued on the copy stream, or
// undefined where the scatter kernel takes `host_dst_ids` by value) are recorded on it, then buffer's rows are
// scattered into dst's rows there: by the row copy kernel with every SM's share of HBM, else index_copy_.
void finish_on_compute(const at::Tensor& dst, const at::Tensor& dst_ids, const std::vector<int64_t>& host_dst_ids,
                       const at::Tensor& buffer, const c10::Stream& copy_stream) {
  join_current(copy_stream, dst.device(), {buffer, dst_ids});
  const int64_t row_bytes = buffer.size(1);
  if (row_copy_fits(buffer.data_ptr(), dst.data_ptr(), row_bytes)) {
    CudaGatherArgs args;
    args.src = buffer.data_ptr();
    args.dst = dst.data_ptr();
    if (dst_ids.defined()) {
      args.dst_ids = dst_ids;
    } else {
      args.host_dst_ids = host_dst_ids.data();
    }
    args.rows = buffer.size(0);
    args.row_bytes = row_bytes;
    args.ctas = kCudaScatterCtas;
    args.device = dst.device().index();
    cuda_gather()(args);
    return;
  }
  TORCH_INTERNAL_ASSERT(dst_ids.defined(), "finish_on_compute: index_copy_ takes a device index");
  auto shape = dst.sizes().vec();
  shape[0] = -1;
  dst.index_copy_(0, dst_ids, buffer.view(dst.scalar_type()).view(shape));
}

// Where the runs of consecutive source blocks start (src_ids[i] == src_ids[i - 1] + 1 continues a run): index 0
// first, then each i that starts a new run.
std::vector<int64_t> run_starts(const std::vector<int64_t>& ids) {
  std::vector<int64_t> starts;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i == 0 || ids[i] != ids[i - 1] + 1) starts.push_back(static_cast<int64_t>(i));
  }
  return starts;
}

// The ids as one device index on the copy stream: src_ids first (for the gather kernel; omitted when `with_src` is
// false), then dst_ids (for the scatter on the compute stream). One pinned buffer, one non-blocking copy.
at::Tensor copy_ids(const std::vector<int64_t>& src_ids, const std::vector<int64_t>& dst_ids, bool with_src,
                    at::Device device) {
  std::vector<int64_t> ids;
  ids.reserve((with_src ? src_ids.size() : 0) + dst_ids.size());
  if (with_src) ids.insert(ids.end(), src_ids.begin(), src_ids.end());
  ids.insert(ids.end(), dst_ids.begin(), dst_ids.end());
  return index_tensor(ids, device);
}
}  // namespace

int64_t mapped_gather_ctas() {
  if (cuda_gather() == nullptr) return 0;
  // ACTIVEKV_GATHER_CTAS (1..1024); unset or out of range: the default.
  return env_int("ACTIVEKV_GATHER_CTAS", 1, 1024, kCudaGatherCtas);
}

int64_t mapped_dma_min_bytes() {
  if (cuda_copy_runs() == nullptr) return -1;
  // ACTIVEKV_DMA_MIN_BYTES (0 .. 2^50: 0 always, a huge value never); unset or out of range: the default.
  return env_int("ACTIVEKV_DMA_MIN_BYTES", 0, int64_t{1} << 50, kCudaDmaMinBytes);
}

int64_t inline_ids_limit() { return env_int("ACTIVEKV_INLINE_IDS", 0, kCudaInlineIds, kCudaInlineIds); }

int64_t copy_blocks_mapped(const at::Tensor& src, const at::Tensor& dst, const std::vector<int64_t>& src_ids,
                           const std::vector<int64_t>& dst_ids, const c10::Stream& copy_stream) {
  check_copy(src, dst, src_ids, dst_ids);
  check_tiered(src, dst, copy_stream);
  return copy_blocks_mapped_unchecked(src, dst, src_ids, dst_ids, copy_stream);
}

namespace {
// copy_blocks_mapped's read over the bus on the current stream (the copy stream, set by the caller): the blocks into a
// new device buffer [n, row_bytes]. Returns {buffer, ids}: ids a device index ending with dst_ids, or undefined where
// the read and the scatter take their ids by value (`by_value`: at most inline_ids_limit() of them, each < 2^31, and
// the scatter kernel takes the buffer).
std::pair<at::Tensor, at::Tensor> read_mapped(const at::Tensor& src, const at::Tensor& dst,
                                              const std::vector<int64_t>& src_ids,
                                              const std::vector<int64_t>& dst_ids, int64_t row_bytes) {
  const auto n = static_cast<int64_t>(src_ids.size());
  // One buffer for whichever read runs (the copy engines, or the gather when the copy engines decline).
  at::Tensor gathered = at::empty({n, row_bytes}, at::TensorOptions().dtype(at::kByte).device(dst.device()));
  const int64_t limit = inline_ids_limit();
  const bool dst_by_value =
      row_copy_fits(gathered.data_ptr(), dst.data_ptr(), row_bytes) && inline_ids_fit(dst_ids.data(), n, limit);
  at::Tensor ids;
  // The copy engines, where the blocks come in runs long enough for them (mapped_dma_min_bytes): one descriptor per
  // run of consecutive source blocks, into consecutive rows of the buffer.
  const int64_t dma_min = mapped_dma_min_bytes();
  const auto starts = dma_min >= 0 ? run_starts(src_ids) : std::vector<int64_t>{};
  const auto runs = static_cast<int64_t>(starts.size());
  if (runs > 0 && n * row_bytes / runs >= dma_min) {  // mean bytes per run (no overflow)
    CudaCopyRunsArgs copy;
    copy.device = dst.device().index();
    auto* from = static_cast<char*>(src.data_ptr());
    auto* to = static_cast<char*>(gathered.data_ptr());
    for (int64_t r = 0; r < runs; ++r) {
      const int64_t i = starts[r], end = r + 1 < runs ? starts[r + 1] : n;
      copy.src.push_back(from + src_ids[i] * row_bytes);
      copy.dst.push_back(to + i * row_bytes);
      copy.bytes.push_back(static_cast<size_t>((end - i) * row_bytes));
    }
    if (cuda_copy_runs()(copy)) {
      if (!dst_by_value) ids = copy_ids(src_ids, dst_ids, /*with_src=*/false, dst.device());
      return {gathered, ids};
    }
  }
  const int64_t ctas = mapped_gather_ctas();
  const bool kernel = ctas > 0 && row_copy_fits(src.data_ptr(), gathered.data_ptr(), row_bytes);
  // The ids by value where both lists fit a launch's parameters, else one uploaded index (src_ids, then dst_ids).
  const bool by_value = kernel && dst_by_value && inline_ids_fit(src_ids.data(), n, limit);
  if (!by_value) ids = copy_ids(src_ids, dst_ids, /*with_src=*/true, dst.device());
  if (kernel) {
    // The gather kernel (cuda_kernel.h CudaGatherArgs): 16-byte loads, many in flight, over the host tier's device
    // mapping (the pinned pointer itself; src outlives the kernel: the engine holds its bound host tier, a caller
    // holds src).
    CudaGatherArgs args;
    args.src = src.data_ptr();
    if (by_value) {
      args.host_src_ids = src_ids.data();
    } else {
      args.src_ids = ids.narrow(0, 0, n);
    }
    args.dst = gathered.data_ptr();
    args.rows = n;
    args.row_bytes = row_bytes;
    args.ctas = ctas;
    args.device = dst.device().index();
    cuda_gather()(args);
  } else {
    // Without the kernel, or rows not 16-byte aligned: index_select over the same mapping, in words of 8 bytes when
    // a block allows it (fewer, wider reads over the bus), else bytes.
    const auto word = row_bytes % 8 == 0 ? at::kLong : at::kByte;
    const int64_t row_words = row_bytes / (word == at::kLong ? 8 : 1);
    auto mapped = at::from_blob(src.data_ptr(), {src.size(0), row_words}, [](void*) {},
                                at::TensorOptions().dtype(word).device(dst.device()));
    auto out = gathered.view(word);
    at::index_select_out(out, mapped, 0, ids.narrow(0, 0, n));  // reads host memory in the kernel
  }
  return {gathered, ids};
}
}  // namespace

int64_t copy_blocks_mapped_unchecked(const at::Tensor& src, const at::Tensor& dst, const std::vector<int64_t>& src_ids,
                                     const std::vector<int64_t>& dst_ids, const c10::Stream& copy_stream) {
  // Addresses below are computed from the blocks' positions: cheap to check, fatal to get wrong.
  AKV_CHECK_VALUE(src.is_contiguous() && dst.is_contiguous(), "src and dst must be contiguous");
  if (src_ids.empty()) return 0;
  const int64_t row_bytes = src.numel() / std::max<int64_t>(src.size(0), 1) * src.element_size();
  const auto n = static_cast<int64_t>(src_ids.size());
  at::Tensor gathered, ids;
  {
    c10::StreamGuard guard(copy_stream);  // the read on the copy stream; the scatter after it on the caller's stream
    std::tie(gathered, ids) = read_mapped(src, dst, src_ids, dst_ids, row_bytes);
  }
  finish_on_compute(dst, ids.defined() ? ids.narrow(0, ids.size(0) - n, n) : ids, dst_ids, gathered, copy_stream);
  return batch_bytes(src, src_ids.size());
}

int64_t copy_blocks_staged(const at::Tensor& src, const at::Tensor& dst, const std::vector<int64_t>& src_ids,
                           const std::vector<int64_t>& dst_ids, const c10::Stream& copy_stream) {
  check_copy(src, dst, src_ids, dst_ids);
  check_tiered(src, dst, copy_stream);
  if (src_ids.empty()) return 0;
  const auto n = static_cast<int64_t>(src_ids.size());
  auto shape = src.sizes().vec();
  shape[0] = n;
  // 1. Gather on the CPU into one pinned buffer (contiguous: one DMA for the batch).
  auto staging = at::empty(shape, src.options().pinned_memory(true));
  at::index_select_out(staging, src, 0, index_tensor(src_ids, at::kCPU));
  // 2. Host-to-device on the copy stream; the device buffer is allocated on that stream.
  at::Tensor on_device;
  {
    c10::StreamGuard guard(copy_stream);
    on_device = staging.to(dst.device(), /*non_blocking=*/true);
  }
  // 3. The compute stream waits for the copy, then scatters into the pool (pool slots are written only there).
  at::Tensor ids;
  {
    c10::StreamGuard guard(copy_stream);
    ids = index_tensor(dst_ids, dst.device());
  }
  finish_on_compute(dst, ids, dst_ids, on_device, copy_stream);
  return batch_bytes(src, src_ids.size());
}

}  // namespace activekv
