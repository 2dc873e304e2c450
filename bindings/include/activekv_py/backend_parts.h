#pragma once
// The _backend module is three files, one per concern, joined here: backend.cpp (the vLLM contract objects and
// capabilities; it defines the module), backend_engine.cpp (the Engine class and the StepPlan its build returns) and
// backend_series.cpp (the patch series check at start-up).
#include <activekv/engine.h>
#include <pybind11/pybind11.h>

#include <memory>

namespace activekv::py_glue {

/// An engine's StepPlan bound to the engine that built it: the attention metadata vLLM passes to every layer's forward.
struct PlanHandle {
  std::shared_ptr<Engine> engine;
  StepPlan plan;
};

/// Registers StepPlan and Engine in the module (backend_engine.cpp).
void register_engine(pybind11::module_& m);

/// Registers check_patch_series, verified_marker and vllm_general_plugin in the module (backend_series.cpp).
void register_series(pybind11::module_& m);

/// Raises RuntimeError when the vLLM this process imported does not carry this wheel's patch series (decided once per
/// process, series/startup.h; nothing when no vLLM is imported). The first Impl / Builder of a process calls it.
void require_patched_vllm();

}  // namespace activekv::py_glue
