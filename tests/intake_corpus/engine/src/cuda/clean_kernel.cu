// A CUDA source with no compile entry (no CUDA toolkit where the screen runs): screened lexically and accepted.
// Comments and strings never count: #include <Python.h>, PyRun_SimpleString("x").
#include <cuda_fp16.h>
#include <ATen/ATen.h>

namespace corpus_engine_cuda_clean {
__global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }
const char* name() { return "no PyObject here"; }
}  // namespace corpus_engine_cuda_clean
