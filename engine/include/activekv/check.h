#pragma once
/// @file check.h
/// @brief Input-check macros and helpers used once, at the engine's entry points.
///
/// Each names the argument, the expectation and what came. They throw c10::Error subclasses that the bindings
/// translate: AKV_CHECK_VALUE -> ValueError, AKV_CHECK_TYPE -> TypeError, AKV_CHECK_INDEX -> IndexError.
#include <ATen/core/Tensor.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <utility>

#define AKV_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)
#define AKV_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, __VA_ARGS__)
#define AKV_CHECK_INDEX(cond, ...) TORCH_CHECK_INDEX(cond, __VA_ARGS__)

namespace activekv {

/// A tensor's view must lie inside its storage: a storage shrunk after the view was made
/// (`untyped_storage().resize_(...)`) would otherwise be read or written past its end by the raw-pointer loops.
/// Meta tensors (no data) pass; check_has_data refuses them where data is read.
/// @throws c10::ValueError naming the argument.
inline void check_in_storage(const at::Tensor& t, const char* name) {
  if (!t.defined() || t.is_meta() || t.numel() == 0 || !t.has_storage()) return;
  // Last element's offset in the storage, in elements (torch strides are never negative).
  int64_t last = t.storage_offset();
  for (int64_t i = 0; i < t.dim(); ++i) last += (t.size(i) - 1) * t.stride(i);
  const auto need = static_cast<uint64_t>(last + 1) * static_cast<uint64_t>(t.element_size());
  const auto held = static_cast<uint64_t>(t.storage().nbytes());
  AKV_CHECK_VALUE(need <= held, name, " must lie inside its storage: the view needs ", need, " bytes, the storage ",
                  "holds ", held, " (was the storage resized after the view was made?)");
}

/// A tensor the engine reads or writes must hold data: a meta tensor (a shape without storage) would otherwise fail
/// deep inside ATen with a message that names no argument, or read a null pointer; and its view must lie inside its
/// storage (check_in_storage).
/// @throws c10::ValueError naming the argument.
inline void check_has_data(const at::Tensor& t, const char* name) {
  AKV_CHECK_VALUE(!t.defined() || !t.is_meta(), name, " must hold data (a CPU or CUDA tensor), got a meta tensor");
  check_in_storage(t, name);
}

/// Two tensor arguments, one of them written, must not share memory: an overlap makes the written bytes depend on
/// the order of the loops. Tensors on different storages never overlap; on one storage, their byte ranges
/// [first element, last element] are compared (conservative for interleaved strided views).
/// @throws c10::ValueError naming both arguments.
inline void check_no_overlap(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0 || !a.has_storage() || !b.has_storage())
    return;
  if (!a.storage().is_alias_of(b.storage())) return;
  const auto range = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t i = 0; i < t.dim(); ++i) last += (t.size(i) - 1) * t.stride(i);
    const auto* first = static_cast<const char*>(t.const_data_ptr());
    return std::pair<const char*, const char*>(first, first + (last + 1) * t.element_size());
  };
  const auto [a0, a1] = range(a);
  const auto [b0, b1] = range(b);
  AKV_CHECK_VALUE(a1 <= b0 || b1 <= a0, a_name, " and ", b_name, " must not share memory, got overlapping views of ",
                  "one storage (pass separate tensors, e.g. ", a_name, ".clone())");
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
