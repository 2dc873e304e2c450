#pragma once
// The _backend module's host-tier functions (bindings/modules/backend_host_tier.cpp): where vLLM allocates the KV cache
// of the layers ActiveKV serves on CUDA, and the CUDA capability answer. backend.cpp registers them on its module and
// hands over its start-up list of the engines whose host tier is not bound yet.
#include <activekv/engine.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

namespace activekv::py_glue {

/// The live engines serving a vLLM layer name whose host tier is not bound yet (backend.cpp, filled by the metadata
/// builders; start-up only).
using EnginesForLayer = std::vector<std::shared_ptr<Engine>> (*)(const std::string& layer_name);

/// Define kv_cache_device, host_tier_buffer and supports_compute_capability on `m`.
void define_host_tier(pybind11::module_& m, EnginesForLayer engines_for_layer);

}  // namespace activekv::py_glue
