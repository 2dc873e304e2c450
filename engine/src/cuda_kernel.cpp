// The CUDA kernel registry: compiled in every build, so the engine links with or without CUDA (cuda_kernel.h).
#include <activekv/cuda_kernel.h>

namespace activekv {

namespace {
// One registry entry per type (every entry's type is distinct): empty until a CUDA translation unit registers it.
template <class T>
T& entry() {
  static T value{};
  return value;
}
}  // namespace

CudaAttendFn cuda_attend() { return entry<CudaAttendFn>(); }
void register_cuda_attend(CudaAttendFn fn) { entry<CudaAttendFn>() = fn; }

const CudaBatchKernel& cuda_batch_kernel() { return entry<CudaBatchKernel>(); }
void register_cuda_batch_kernel(const CudaBatchKernel& kernel) { entry<CudaBatchKernel>() = kernel; }

CudaKvWriteFn cuda_kv_write() { return entry<CudaKvWriteFn>(); }
void register_cuda_kv_write(CudaKvWriteFn fn) { entry<CudaKvWriteFn>() = fn; }

CudaGatherFn cuda_gather() { return entry<CudaGatherFn>(); }
void register_cuda_gather(CudaGatherFn fn) { entry<CudaGatherFn>() = fn; }

CudaCopyRunsFn cuda_copy_runs() { return entry<CudaCopyRunsFn>(); }
void register_cuda_copy_runs(CudaCopyRunsFn fn) { entry<CudaCopyRunsFn>() = fn; }

}  // namespace activekv
