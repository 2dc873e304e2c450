// A CUDA source that brings Python into the engine: rejected even where it cannot be parsed as CUDA.
#include <cuda_fp16.h>
#include <pybind11/pybind11.h>  // expect: python-in-engine

namespace corpus_engine_cuda_python {
__global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }
void report() { PyRun_SimpleString("print(1)"); }  // expect: python-in-engine
}  // namespace corpus_engine_cuda_python
