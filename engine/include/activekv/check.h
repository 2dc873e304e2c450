#pragma once
/// @file check.h
/// @brief Input-check macros and helpers used once, at the engine's entry points.
///
/// Each names the argument, the expectation and what came. They throw c10::Error subclasses that the bindings
/// translate: AKV_CHECK_VALUE -> ValueError, AKV_CHECK_TYPE -> TypeError, AKV_CHECK_INDEX -> IndexError.
#include <ATen/core/Tensor.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#define AKV_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)
#define AKV_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, __VA_ARGS__)
#define AKV_CHECK_INDEX(cond, ...) TORCH_CHECK_INDEX(cond, __VA_ARGS__)

namespace activekv {

/// A tensor the engine reads or writes must hold data: a meta tensor (a shape without storage) would otherwise fail
/// deep inside ATen with a message that names no argument, or read a null pointer.
/// @throws c10::ValueError naming the argument.
inline void check_has_data(const at::Tensor& t, const char* name) {
  AKV_CHECK_VALUE(!t.defined() || !t.is_meta(), name, " must hold data (a CPU or CUDA tensor), got a meta tensor");
}

/// A tensor the engine writes in place, or reads under autograd, must be plain data; checked before anything changes.
/// @throws c10::ValueError naming the argument.
inline void check_writable(const at::Tensor& t, const char* name) {
  check_has_data(t, name);
  AKV_CHECK_VALUE(!t.requires_grad(), name, " must not require grad (ActiveKV computes without autograd)");
  AKV_CHECK_VALUE(!t.is_inference() || c10::InferenceMode::is_enabled(), name,
                  " is an inference tensor: call under torch.inference_mode(), as vLLM does");
}

}  // namespace activekv
