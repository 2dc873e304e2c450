#pragma once
/// @file check.h
/// @brief Input-check macros used once, at the engine's entry points.
///
/// Each names the argument, the expectation and what came. They throw c10::Error subclasses that the bindings
/// translate: AKV_CHECK_VALUE -> ValueError, AKV_CHECK_TYPE -> TypeError, AKV_CHECK_INDEX -> IndexError.
#include <c10/util/Exception.h>

#define AKV_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)
#define AKV_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, __VA_ARGS__)
#define AKV_CHECK_INDEX(cond, ...) TORCH_CHECK_INDEX(cond, __VA_ARGS__)
