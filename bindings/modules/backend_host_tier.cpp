// Part of activekv._backend: the host tier of vLLM's KV cache on CUDA (engine/include/activekv/host_tier.h) and the
// CUDA capability answer. Glue only: reads vLLM's objects' attributes at start-up, never imports a module.
//
// vLLM allocates each KV cache in vllm/v1/worker/utils.py, allocate_kv_cache: `buf = torch.zeros(buf_size,
// dtype=torch.int8, device=device)`, then views it per layer. ActiveKV's patch series (0005) wraps that one line:
// `device = _backend.kv_cache_device(kv_cache_config, device)` before it and `buf = _backend.host_tier_buffer(buf)`
// after it. For a KV cache whose every layer is served by an ActiveKV engine on that CUDA device, the first answers
// the meta device (torch.zeros allocates nothing) and the second replaces the meta buffer by the host tier, pinned CPU
// memory of the same size, natively; any other KV cache passes through both unchanged.
#include <activekv/check.h>
#include <activekv/host_tier.h>
#include <activekv_py/common.h>
#include <activekv_py/host_tier.h>

#include <c10/core/impl/VirtualGuardImpl.h>

namespace py = pybind11;

namespace activekv::py_glue {

namespace {

// "cuda" means the current CUDA device, as the engine reads it.
at::Device indexed(at::Device device) {
  if (device.is_cpu() || device.has_index()) return device;
  return c10::impl::VirtualGuardImpl(device.type()).getDevice();
}

// The live engine on `device` that serves layer `name` and has not bound its host tier yet, or null: the engine of the
// model runner whose KV cache is being allocated (vLLM creates the metadata builders, hence the engines, before it
// allocates the KV cache, vllm/v1/worker/gpu_model_runner.py initialize_kv_cache; an engine binds its host tier at its
// first KV update or forward, so an older engine that has run is never taken for this one).
std::shared_ptr<Engine> served_here(EnginesForLayer engines_for_layer, const std::string& name, at::Device device) {
  for (const auto& e : engines_for_layer(name))
    if (e->device() == device && e->host_binding(e->layer_index(name), at::Tensor()) == Engine::HostBinding::kUnbound)
      return e;
  return nullptr;
}

}  // namespace

void define_host_tier(py::module_& m, EnginesForLayer engines_for_layer) {
  m.def(
      "kv_cache_device",
      [engines_for_layer](py::handle kv_cache_config, at::Device device) {
        if (!device.is_cuda()) return device;
        const at::Device dev = indexed(device);
        TORCH_CHECK_TYPE(py::hasattr(kv_cache_config, "kv_cache_tensors"),
                         "kv_cache_config.kv_cache_tensors is missing (expected vLLM's KVCacheConfig), got a ",
                         std::string(py::str(py::type::of(kv_cache_config))));
        // served: layers of engines with a pool (their KV cache is the host tier, in pinned host memory); other:
        // layers of another backend, or of an engine that attends in place (its KV cache stays on the device).
        std::vector<std::string> served, other;
        for (py::handle tensor : kv_cache_config.attr("kv_cache_tensors")) {
          TORCH_CHECK_TYPE(py::hasattr(tensor, "layers"), "kv_cache_config.kv_cache_tensors[i].layers is missing");
          for (py::handle layer : tensor.attr("layers")) {
            TORCH_CHECK_TYPE(py::isinstance<py::str>(layer), "kv_cache_tensors[i].layers must hold str, got ",
                             std::string(py::repr(layer)));
            const auto name = layer.cast<std::string>();
            const auto e = served_here(engines_for_layer, name, dev);
            (e != nullptr && e->config().placement == Placement::kPool ? served : other).push_back(name);
          }
        }
        if (served.empty()) return device;
        // One backing buffer holds every layer's KV cache: it cannot be host memory for some and device memory for
        // the others.
        TORCH_CHECK_NOT_IMPLEMENTED(other.empty(), "ActiveKV keeps its layers' KV cache in pinned host memory on ",
                                    dev, ", but this KV cache also holds layers of another attention backend or of "
                                    "placement 'in_place' ('", other.front(), "' beside '", served.front(),
                                    "'); serve every attention layer with ACTIVEKV, all with one placement");
        return at::Device(at::kMeta);
      },
      py::arg("kv_cache_config"), py::arg("device"),
      "Where vLLM's allocate_kv_cache allocates the backing buffer of kv_cache_config (vLLM's KVCacheConfig) meant "
      "for `device` (torch.device): the meta device when every layer of it is served by an ActiveKV engine with a "
      "pool on that CUDA device that has not run yet (host_tier_buffer then allocates it in pinned host memory), else "
      "`device` unchanged (an engine that attends in place reads its KV cache in the device's memory). Raises "
      "NotImplementedError for a KV cache that mixes such layers with another backend's or in-place ones.");
  m.def(
      "host_tier_buffer",
      [](const at::Tensor& buf) {
        if (!buf.is_meta()) return buf;
        AKV_CHECK_VALUE(buf.dim() == 1 && buf.scalar_type() == at::kChar,
                        "a host-tier buffer must be a 1-D int8 meta tensor (vLLM's KV-cache backing buffer), got ",
                        buf.scalar_type(), " ", shape_str(buf.sizes()));
        py::gil_scoped_release release;
        return pinned_host_zeros(buf.numel());
      },
      py::arg("buf"),
      "vLLM's KV-cache backing buffer after allocation: a 1-D int8 meta tensor (kv_cache_device chose the host tier) "
      "becomes a zeroed int8 CPU tensor of the same size in page-locked host memory mapped into the CUDA device's "
      "address space (the engine's tiered host tier); any other tensor is returned as it is. Raises RuntimeError when "
      "CUDA cannot pin that much host memory.");
  m.def(
      "supports_compute_capability",
      [](py::handle capability) {
        // The series' CPU routing (0003) validates ACTIVEKV with device_capability=None: no CUDA device, nothing to
        // refuse there.
        if (capability.is_none()) return true;
        int64_t part[2] = {0, 0};
        const char* names[2] = {"major", "minor"};
        for (int i = 0; i < 2; ++i) {
          py::object v = py::none();
          if (py::hasattr(capability, names[i])) v = capability.attr(names[i]);
          int overflow = 1;
          long long x = 0;
          if (py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v))
            x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
          TORCH_CHECK_TYPE(overflow == 0, "capability must be None or a DeviceCapability with int major and minor, "
                           "got ", std::string(py::repr(capability)));
          part[i] = x;
        }
        return cuda_capability_supported(part[0], part[1]);
      },
      py::arg("capability"),
      "Whether ActiveKV runs on a CUDA device of this compute capability (vLLM's DeviceCapability: major, minor): "
      "the built CUDA kernel's lowest architecture or newer; any, in a build without the kernel (ATen path). True "
      "for None, which vLLM's CPU platform passes.");
}

}  // namespace activekv::py_glue
