// The CUDA kernel registry: compiled in every build, so the engine links with or without CUDA (cuda_kernel.h).
#include <activekv/cuda_kernel.h>

namespace activekv {

namespace {
CudaAttendFn& slot() {
  static CudaAttendFn fn = nullptr;
  return fn;
}
}  // namespace

CudaAttendFn cuda_attend() { return slot(); }
void register_cuda_attend(CudaAttendFn fn) { slot() = fn; }

namespace {
CudaBatchKernel& batch_slot() {
  static CudaBatchKernel kernel;
  return kernel;
}
}  // namespace

const CudaBatchKernel& cuda_batch_kernel() { return batch_slot(); }
void register_cuda_batch_kernel(const CudaBatchKernel& kernel) { batch_slot() = kernel; }

namespace {
CudaKvWriteFn& kv_write_slot() {
  static CudaKvWriteFn fn = nullptr;
  return fn;
}
}  // namespace

CudaKvWriteFn cuda_kv_write() { return kv_write_slot(); }
void register_cuda_kv_write(CudaKvWriteFn fn) { kv_write_slot() = fn; }

namespace {
CudaGatherFn& gather_slot() {
  static CudaGatherFn fn = nullptr;
  return fn;
}
}  // namespace

CudaGatherFn cuda_gather() { return gather_slot(); }
void register_cuda_gather(CudaGatherFn fn) { gather_slot() = fn; }

namespace {
CudaCopyRunsFn& copy_runs_slot() {
  static CudaCopyRunsFn fn = nullptr;
  return fn;
}
}  // namespace

CudaCopyRunsFn cuda_copy_runs() { return copy_runs_slot(); }
void register_cuda_copy_runs(CudaCopyRunsFn fn) { copy_runs_slot() = fn; }

}  // namespace activekv
