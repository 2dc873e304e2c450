// activekv._backend: the vLLM-facing backend objects (Builder, Impl, the capabilities vLLM reads) over the engine
// (engine/include/activekv/engine.h; the Engine class itself is registered by backend_engine.cpp).
//
// vLLM's patched Python (vllm/v1/attention/backends/activekv.py, patches/vllm/v0.32.0/0002-*.patch) imports this module
// and delegates each contract method in one line. This file reads vLLM's objects into plain values (attributes only,
// plus one config method at start-up) and calls the engine: options and defaults are engine/include/activekv/options.h,
// the Impl's engines engine/include/activekv/layer_binding.h, the patch series check series/startup.h (the check
// `activekv serve` runs before Python starts). It never imports a Python module or calls a Python callable on the
// per-step path.
#include <activekv/cpu_kernel.h>
#include <activekv/engine.h>
#include <activekv/layer_binding.h>
#include <activekv/options.h>
#include <activekv_py/common.h>
#include <activekv_py/backend_parts.h>
#include <activekv_py/host_tier.h>
#include <activekv_py/vllm_args.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;
using activekv::Engine;
using activekv::py_glue::attr_as;
using activekv::py_glue::cast_named;
using activekv::py_glue::layer_name;
using activekv::py_glue::PlanHandle;
using activekv::py_glue::require_patched_vllm;
using activekv::py_glue::utf8_str;

namespace {

// ---- the vLLM contract objects ----

/// vLLM's AttentionImpl of one layer: its constructor arguments, and the engines that serve the layer (bound by the
/// metadata builders that serve it: Builder below).
struct Impl {
  int64_t num_heads;
  int64_t head_size;
  double scale;
  int64_t num_kv_heads;
  std::string kv_cache_dtype;
  std::string attn_type;
  activekv::LayerBindings engines;
};

// The head sizes vLLM may ask the backend for (supported_head_sizes); Impl and Builder both refuse any other, the
// message naming where the size came from (`what`).
void check_head_size(int64_t head_size, const char* what) {
  const auto sizes = activekv::supported_head_sizes();
  TORCH_CHECK_NOT_IMPLEMENTED(std::find(sizes.begin(), sizes.end(), head_size) != sizes.end(), what,
                              ": ActiveKV's vLLM backend supports head sizes ", c10::IntArrayRef(sizes), ", got ",
                              head_size);
}

Impl make_impl(int64_t num_heads, int64_t head_size, double scale, py::object num_kv_heads, py::object alibi_slopes,
               py::object sliding_window, const std::string& kv_cache_dtype, py::object logits_soft_cap,
               py::object attn_type, py::object kv_sharing_target_layer_name, py::object sinks) {
  require_patched_vllm();  // vLLM builds every attention layer's Impl at model construction, before the Builders
  TORCH_CHECK_VALUE(std::isfinite(scale), "scale must be a finite number, got ", scale);
  TORCH_CHECK_NOT_IMPLEMENTED(alibi_slopes.is_none(), "ActiveKV does not support ALiBi slopes");
  TORCH_CHECK_NOT_IMPLEMENTED(sliding_window.is_none(), "ActiveKV does not support sliding-window attention, got ",
                              std::string(py::repr(sliding_window)));
  TORCH_CHECK_NOT_IMPLEMENTED(kv_cache_dtype == "auto", "ActiveKV supports kv_cache_dtype 'auto' only, got '",
                              kv_cache_dtype, "'");
  TORCH_CHECK_NOT_IMPLEMENTED(logits_soft_cap.is_none() ||
                                  cast_named<double>(logits_soft_cap, "logits_soft_cap", "a float or None") == 0.0,
                              "ActiveKV does not support logits soft-capping, got ",
                              std::string(py::repr(logits_soft_cap)));
  const std::string at =
      attn_type.is_none() ? "decoder" : cast_named<std::string>(attn_type, "attn_type", "a str (AttentionType)");
  TORCH_CHECK_NOT_IMPLEMENTED(at == "decoder", "ActiveKV supports decoder attention only, got '", at, "'");
  TORCH_CHECK_NOT_IMPLEMENTED(kv_sharing_target_layer_name.is_none(),
                              "ActiveKV does not support KV sharing across layers, got ",
                              std::string(py::repr(kv_sharing_target_layer_name)));
  TORCH_CHECK_NOT_IMPLEMENTED(sinks.is_none(), "ActiveKV does not support attention sinks");
  const int64_t kvh =
      num_kv_heads.is_none() ? num_heads : cast_named<int64_t>(num_kv_heads, "num_kv_heads", "an int or None");
  TORCH_CHECK_VALUE(num_heads > 0 && kvh > 0 && num_heads % kvh == 0,
                    "num_heads must be a positive multiple of num_kv_heads, got ", num_heads, " and ", kvh);
  check_head_size(head_size, "head_size");
  return Impl{num_heads, head_size, scale, kvh, kv_cache_dtype, at, {}};
}

/// additional_config["activekv"] as option name -> value text (options.h): every key a known option, every value of
/// its option's kind. vLLM types additional_config as `dict | SupportsHash`: a dict is read; an object of another kind
/// that is no mapping belongs to someone else and carries no ActiveKV options; a mapping of another type
/// (MappingProxyType, ...) that names "activekv" is refused rather than silently ignored. Start-up only.
activekv::OptionValues activekv_options(const py::handle& vllm_config) {
  TORCH_CHECK_TYPE(py::hasattr(vllm_config, "additional_config"),
                   "vllm_config must be vLLM's VllmConfig (with an additional_config), got ",
                   std::string(py::repr(vllm_config)));
  py::object extra = vllm_config.attr("additional_config");
  if (extra.is_none()) return {};
  if (!py::isinstance<py::dict>(extra)) {
    const bool mapping = py::hasattr(extra, "keys") && py::hasattr(extra, "__getitem__") &&
                         py::hasattr(extra, "__contains__");
    TORCH_CHECK_TYPE(!mapping || !extra.attr("__contains__")("activekv").cast<bool>(),
                     "additional_config must be a dict to carry ActiveKV options, got a ",
                     std::string(py::str(py::type::of(extra))));
    return {};
  }
  py::dict d = extra.cast<py::dict>();
  // A key that spells "activekv" in other letter cases ("ActiveKV") is the user's options under a name never read.
  const py::str name("activekv");
  for (auto item : d) {
    if (!py::isinstance<py::str>(item.first) || item.first.equal(name)) continue;
    TORCH_CHECK_VALUE(!item.first.attr("lower")().equal(name), "additional_config[", std::string(py::repr(item.first)),
                      "] is not read: ActiveKV's options go under the lower-case key 'activekv'");
  }
  if (!d.contains("activekv")) return {};
  py::object opts = d["activekv"];
  TORCH_CHECK_TYPE(py::isinstance<py::dict>(opts), "additional_config['activekv'] must be a dict, got ",
                   std::string(py::repr(opts)));
  std::vector<std::pair<std::string, py::object>> items;
  for (auto item : opts.cast<py::dict>()) {
    items.emplace_back(utf8_str(item.first, "an additional_config['activekv'] key"),
                       py::reinterpret_borrow<py::object>(item.second));
    activekv::option_kind(items.back().first);  // ValueError naming the known options
  }
  // Text first, then the path, then the ints: the order the options were read in before the engine checks them.
  activekv::OptionValues out;
  for (const auto kind : {activekv::OptionKind::kText, activekv::OptionKind::kPath, activekv::OptionKind::kInt}) {
    for (const auto& [key, v] : items) {
      if (activekv::option_kind(key) != kind) continue;
      const std::string what = "additional_config['activekv']['" + key + "']";
      if (kind == activekv::OptionKind::kText) {
        out[key] = utf8_str(v, what);
      } else if (kind == activekv::OptionKind::kInt) {
        TORCH_CHECK_TYPE(py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v), what, " must be an int, got ",
                         std::string(py::repr(v)));
        out[key] = std::string(py::str(v));  // decimal digits, however large: the engine checks the range
      } else {
        TORCH_CHECK_TYPE(py::isinstance<py::str>(v), what, " must be a str, got ", std::string(py::repr(v)));
        // A path's bytes as Python's os functions would use them (a name of undecodable bytes is a valid path).
        out[key] = activekv::py_glue::path_arg(v, what, "file path");
      }
    }
  }
  return out;
}

/// The check vLLM's configuration gets in the user's process (the patch calls it from the platform's
/// check_and_update_config, which vLLM runs as it makes the configuration): the options in additional_config['activekv']
/// against the model's geometry (the Builder's group as the model's configuration states it), so that a wrong option
/// fails in LLM(...) or at `vllm serve`'s start with its own message, before any engine core loads the model; and the
/// KV cache's block size against the kernels' (kernel_block_size, options.h). Nothing is built. Without a model or a
/// block size yet, or (for the options) without options, there is nothing of the user's to check here: the Builder
/// checks everything again in the engine core. Start-up only.
void check_config(const py::handle& vllm_config) {
  const activekv::OptionValues options = activekv_options(vllm_config);
  py::object model_config = py::getattr(vllm_config, "model_config", py::none());
  py::object cache_config = py::getattr(vllm_config, "cache_config", py::none());
  if (model_config.is_none() || cache_config.is_none()) return;
  py::object block_size = py::getattr(cache_config, "block_size", py::none());
  if (block_size.is_none()) return;
  // The kernels' block size, as vLLM will choose it for this cache: a block size no kernel takes fails here too.
  const int64_t kernel_block =
      activekv::kernel_block_size(cast_named<int64_t>(block_size, "cache_config.block_size", "an int"));
  if (options.empty()) return;
  py::object parallel = vllm_config.attr("parallel_config");
  activekv::KvCacheGroup group;
  // The model configuration's own accessors, as vLLM sizes each attention layer's KV-cache spec from them.
  group.num_layers = cast_named<int64_t>(model_config.attr("get_num_layers_by_block_type")(parallel, "attention"),
                                         "model_config.get_num_layers_by_block_type(parallel_config)", "an int");
  group.num_heads = cast_named<int64_t>(model_config.attr("get_num_attention_heads")(parallel),
                                        "model_config.get_num_attention_heads(parallel_config)", "an int");
  group.num_kv_heads = cast_named<int64_t>(model_config.attr("get_num_kv_heads")(parallel),
                                           "model_config.get_num_kv_heads(parallel_config)", "an int");
  group.head_size =
      cast_named<int64_t>(model_config.attr("get_head_size")(), "model_config.get_head_size()", "an int");
  group.block_size = kernel_block;
  group.dtype = attr_as<at::ScalarType>(model_config, "model_config", "dtype", "a torch.dtype");
  group.max_num_seqs = activekv::py_glue::int_attr_or(vllm_config, "scheduler_config", "max_num_seqs");
  const std::string device = attr_as<std::string>(vllm_config.attr("device_config"), "device_config", "device_type",
                                                  "a str");
  TORCH_CHECK_VALUE(device == "cpu" || device == "cuda", "ActiveKV runs on the CPU or a CUDA device, got device_type '",
                    device, "'");
  group.device = at::Device(device == "cpu" ? at::kCPU : at::kCUDA);
  activekv::check_backend_options(options, group);
}

/// The native Impl of each layer a builder serves, found as vLLM's own builders find their layers: vLLM's
/// get_layers_from_vllm_config reads vllm_config.compilation_config.static_forward_context[name], and vLLM's CPU
/// metadata builder reads each layer's impl there. The layer's impl is the patch's ActiveKVImpl, whose _native is the
/// Impl of this module (patches/vllm/v0.32.0/0002-*.patch).
/// nullptr for a name without such a layer (a configuration without compilation_config: the bindings driven
/// directly). Start-up only.
std::vector<Impl*> layer_impls(const py::handle& vllm_config, const std::vector<std::string>& names) {
  std::vector<Impl*> out(names.size(), nullptr);
  py::object cc = py::getattr(vllm_config, "compilation_config", py::none());
  if (cc.is_none()) return out;
  py::object ctx = py::getattr(cc, "static_forward_context", py::none());
  TORCH_CHECK_TYPE(py::isinstance<py::dict>(ctx), "vllm_config.compilation_config.static_forward_context must be a "
                   "dict of vLLM's attention layers, got ", std::string(py::repr(ctx)));
  py::dict layers = ctx.cast<py::dict>();
  for (size_t i = 0; i < names.size(); ++i) {
    if (!layers.contains(names[i])) continue;
    py::object impl = py::getattr(layers[py::str(names[i])], "impl", py::none());
    py::object native = py::getattr(impl, "_native", py::none());
    if (py::isinstance<Impl>(native)) out[i] = native.cast<Impl*>();
  }
  return out;
}

/// The engines Builders made whose host tier is not bound yet, for the one lookup by layer name left: vLLM allocates the
/// KV cache after it has built the metadata builders (vllm/v1/worker/gpu_model_runner.py initialize_kv_cache) and
/// hands allocate_kv_cache only the KVCacheConfig, whose layer names are all it has to say which engine a buffer is
/// for (backend_host_tier.cpp, kv_cache_device). Start-up only: an engine leaves the list once its host tier is bound
/// or it is released, and no per-step path reads it.
std::vector<std::weak_ptr<Engine>>& unbound_engines() {
  static std::vector<std::weak_ptr<Engine>> engines;
  return engines;
}

std::vector<std::shared_ptr<Engine>> engines_awaiting_host_tier(const std::string& layer_name) {
  auto& all = unbound_engines();
  std::vector<std::shared_ptr<Engine>> out;
  std::vector<std::weak_ptr<Engine>> keep;
  for (const auto& w : all) {
    auto e = w.lock();
    if (!e) continue;
    bool unbound = false;
    for (int64_t l = 0; l < e->geometry().num_layers && !unbound; ++l)
      unbound = e->host_binding(l, at::Tensor()) == Engine::HostBinding::kUnbound;
    if (!unbound) continue;
    keep.push_back(w);
    if (e->serves_layer(layer_name)) out.push_back(std::move(e));
  }
  all = std::move(keep);
  return out;
}

/// vLLM's AttentionMetadataBuilder of one KV-cache group: its engine, whose layers it binds to their Impls.
struct Builder {
  std::shared_ptr<Engine> engine;
};

Builder make_builder(const py::handle& kv_cache_spec, const std::vector<std::string>& layer_names,
                     const py::handle& vllm_config, at::Device device) {
  require_patched_vllm();
  activekv::KvCacheGroup group;
  group.num_layers = static_cast<int64_t>(layer_names.size());
  group.block_size = attr_as<int64_t>(kv_cache_spec, "kv_cache_spec", "block_size", "an int");
  group.num_kv_heads = attr_as<int64_t>(kv_cache_spec, "kv_cache_spec", "num_kv_heads", "an int");
  group.head_size = attr_as<int64_t>(kv_cache_spec, "kv_cache_spec", "head_size", "an int");
  check_head_size(group.head_size, "kv_cache_spec.head_size");
  group.dtype = attr_as<at::ScalarType>(kv_cache_spec, "kv_cache_spec", "dtype", "a torch.dtype");
  if (py::hasattr(kv_cache_spec, "sliding_window")) {
    TORCH_CHECK_NOT_IMPLEMENTED(kv_cache_spec.attr("sliding_window").is_none(),
                                "ActiveKV does not support sliding-window KV-cache groups");
  }
  // Start-up only: the one config method vLLM offers for the per-rank query head count.
  py::object model_config = vllm_config.attr("model_config");
  group.num_heads =
      cast_named<int64_t>(model_config.attr("get_num_attention_heads")(vllm_config.attr("parallel_config")),
                          "model_config.get_num_attention_heads(parallel_config)", "an int");
  // As vLLM's own metadata builders read them (options.h, compressed_default_pool).
  group.max_num_seqs = activekv::py_glue::int_attr_or(vllm_config, "scheduler_config", "max_num_seqs");
  group.num_gpu_blocks = activekv::py_glue::int_attr_or(vllm_config, "cache_config", "num_gpu_blocks");
  group.device = device;
  const activekv::OptionValues options = activekv_options(vllm_config);
  const std::vector<Impl*> impls = layer_impls(vllm_config, layer_names);
  auto engine = activekv::make_backend_engine(activekv::backend_config(options, group), layer_names, device);
  for (size_t i = 0; i < impls.size(); ++i)
    if (impls[i] != nullptr) impls[i]->engines.bind(engine, layer_names[i]);
  unbound_engines().push_back(engine);
  return Builder{engine};
}

at::Tensor cpu_attr(py::handle obj, const char* primary, const char* fallback) {
  py::object v = py::none();
  if (py::hasattr(obj, primary)) v = obj.attr(primary);
  if (!v.is_none()) return cast_named<at::Tensor>(v, std::string("common_attn_metadata.") + primary, "a tensor");
  return attr_as<at::Tensor>(obj, "common_attn_metadata", fallback, "a tensor");
}

}  // namespace

PYBIND11_MODULE(_backend, m) {
  m.doc() =
      "ActiveKV engine and vLLM attention-backend objects. KV-cache layout: [num_blocks, num_kv_heads, 2, "
      "block_size, head_size] over vLLM's LBHNC per-layer tensor.";
  activekv::py_glue::register_exceptions(m);
  m.attr("__version__") = activekv::engine_version();
  m.attr("torch_version") = activekv::engine_torch_version();
  m.attr("vllm_patch_version") = ACTIVEKV_VLLM_PATCH_VERSION;
  activekv::py_glue::register_engine(m);

  py::class_<Builder>(m, "Builder", "vLLM AttentionMetadataBuilder delegate: creates the engine for a KV-cache group.")
      .def(py::init(&make_builder),
           py::arg("kv_cache_spec"), py::arg("layer_names"), py::arg("vllm_config"), py::arg("device"))
      .def(
          "build",
          [](const Builder& b, int64_t common_prefix_len, py::object cm, bool fast_build) {
            TORCH_CHECK_TYPE(py::hasattr(cm, "causal"), "common_attn_metadata.causal is missing");
            py::object causal = cm.attr("causal");
            TORCH_CHECK_NOT_IMPLEMENTED(py::isinstance<py::bool_>(causal) && causal.cast<bool>(),
                                        "ActiveKV supports causal attention only (common_attn_metadata.causal must be "
                                        "True), got ", std::string(py::repr(causal)));
            const at::Tensor qsl = cpu_attr(cm, "query_start_loc_cpu", "query_start_loc");
            const char* owner = "common_attn_metadata";
            const auto seq_lens = attr_as<at::Tensor>(cm, owner, "seq_lens", "a tensor");
            const auto block_table = attr_as<at::Tensor>(cm, owner, "block_table_tensor", "a tensor");
            const auto num_reqs = attr_as<int64_t>(cm, owner, "num_reqs", "an int");
            const auto num_actual_tokens = attr_as<int64_t>(cm, owner, "num_actual_tokens", "an int");
            // The step's slot mapping, checked once here for the layers' KV updates (Engine::build); optional.
            at::Tensor slot_mapping;
            if (py::object sm = py::getattr(cm, "slot_mapping", py::none()); !sm.is_none())
              slot_mapping = cast_named<at::Tensor>(sm, "common_attn_metadata.slot_mapping", "a tensor");
            PlanHandle h{b.engine, {}};
            py::gil_scoped_release release;
            h.plan = b.engine->build(qsl, seq_lens, block_table, num_reqs, num_actual_tokens, slot_mapping);
            return h;
          },
          py::arg("common_prefix_len"), py::arg("common_attn_metadata"), py::arg("fast_build") = false,
          "Plan a step from vLLM's CommonAttentionMetadata; returns the StepPlan vLLM passes to forward.")
      .def_property_readonly("engine", [](const Builder& b) { return b.engine; }, "The engine this builder created.");

  py::class_<Impl>(m, "Impl", "vLLM AttentionImpl delegate: KV update and forward for one attention layer.")
      .def(py::init(&make_impl), py::arg("num_heads"), py::arg("head_size"), py::arg("scale"),
           py::arg("num_kv_heads") = py::none(), py::arg("alibi_slopes") = py::none(),
           py::arg("sliding_window") = py::none(), py::arg("kv_cache_dtype") = "auto",
           py::arg("logits_soft_cap") = py::none(), py::arg("attn_type") = py::none(),
           py::arg("kv_sharing_target_layer_name") = py::none(), py::arg("sinks") = py::none())
      .def_readonly("num_heads", &Impl::num_heads)
      .def_readonly("head_size", &Impl::head_size)
      .def_readonly("scale", &Impl::scale)
      .def_readonly("num_kv_heads", &Impl::num_kv_heads)
      .def_readonly("kv_cache_dtype", &Impl::kv_cache_dtype)
      .def_readonly("attn_type", &Impl::attn_type)
      .def(
          "forward",
          [](const Impl& impl, py::object layer, const at::Tensor& query, py::object key, py::object value,
             const at::Tensor& kv_cache, py::object attn_metadata, const at::Tensor& output, py::object output_scale,
             py::object output_block_scale) {
            TORCH_CHECK_NOT_IMPLEMENTED(output_scale.is_none() && output_block_scale.is_none(),
                                        "ActiveKV does not support fused output quantization");
            const std::string name = layer_name(layer);
            // No metadata: vLLM's warm-up / profiling run, a no-op by the backend contract (vLLM's CPU backend
            // returns output untouched). In vLLM's default compiled mode it comes before initialize_kv_cache creates
            // any metadata builder (the CPU worker runs profile_run first), so no engine may be bound yet: the
            // forward is counted only on an engine this cache identifies, never required, never guessed.
            if (attn_metadata.is_none()) {
              if (auto served = impl.engines.for_skipped_forward(name, kv_cache); served.engine)
                served.engine->note_forward_skipped();
              return output;
            }
            TORCH_CHECK_TYPE(py::isinstance<PlanHandle>(attn_metadata),
                             "attn_metadata must be an activekv StepPlan (from the ActiveKV metadata builder), got ",
                             std::string(py::str(py::type::of(attn_metadata))));
            const auto& plan = attn_metadata.cast<const PlanHandle&>();
            const int64_t idx = plan.engine->layer_index(name);
            py::gil_scoped_release release;
            plan.engine->forward(idx, plan.plan, query, kv_cache, output, impl.scale);
            return output;
          },
          py::arg("layer"), py::arg("query"), py::arg("key"), py::arg("value"), py::arg("kv_cache"),
          py::arg("attn_metadata"), py::arg("output"), py::arg("output_scale") = py::none(),
          py::arg("output_block_scale") = py::none(),
          "query [T, H, D] attends over the layer's KV cache; writes and returns output [T, H, D].")
      .def(
          "do_kv_cache_update",
          [](const Impl& impl, py::object layer, const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
             const at::Tensor& slot_mapping) {
            const auto served = impl.engines.for_kv_update(layer_name(layer), kv_cache);
            py::gil_scoped_release release;
            served.engine->update_kv(served.layer, key, value, kv_cache, slot_mapping);
          },
          py::arg("layer"), py::arg("key"), py::arg("value"), py::arg("kv_cache"), py::arg("slot_mapping"),
          "Write key/value [T, KVH, D] into the layer's KV cache at slot_mapping (-1 = padding).");

  activekv::py_glue::register_series(m);
  activekv::py_glue::define_host_tier(m, &engines_awaiting_host_tier);  // backend_host_tier.cpp
  m.def("name", []() { return std::string("ACTIVEKV"); }, "The backend name vLLM selects.");
  m.def("check_config", &check_config, py::arg("vllm_config"),
        "Check additional_config['activekv'] against the model's geometry as vLLM makes its configuration (the "
        "platform's check_and_update_config): ValueError / TypeError naming the option; builds nothing.");
  m.def("cpu_kernel_capability", &activekv::cpu_kernel_capability,
        "CPU capability of the fast kernel in use: 'avx512', 'avx2' or 'default' (ATEN_CPU_CAPABILITY caps it).");
  m.def("cpu_kernel_amx", &activekv::cpu_kernel_has_amx,
        "Whether the fast CPU kernel multiplies bfloat16 KV on AMX tiles (head size a multiple of 32, block size a "
        "multiple of 16): capability avx512, a processor with AMX-BF16, Linux granting the tile state, ACTIVEKV_CPU_AMX not '0'.");
  m.def("parallel_for_threads", &activekv::parallel_for_threads, py::arg("n"),
        py::call_guard<py::gil_scoped_release>(),
        "Distinct threads that ran n tasks through at::parallel_for in the engine library (1 if it was built without "
        "OpenMP, whatever torch.get_num_threads() says). Raises ValueError if n < 1.");
  m.def("supported_dtypes", &activekv::supported_dtypes, "Model dtypes the backend supports.");
  m.def("supported_kv_cache_dtypes", []() { return std::vector<std::string>{"auto"}; },
        "KV-cache dtypes the backend supports (no fp8).");
  m.def("supported_head_sizes", &activekv::supported_head_sizes, "Head sizes the backend supports.");
  m.def("supported_block_sizes", &activekv::supported_block_sizes, "KV-cache block sizes the backend supports.");
  m.def("supports_sliding_window", []() { return false; }, "Sliding-window attention: not supported.");
  m.def("supports_sink", []() { return false; }, "Attention sinks: not supported.");
  m.def("supports_non_causal", []() { return false; }, "Non-causal attention: not supported.");
  m.def("supports_kv_connector", []() { return false; }, "KV connectors: not supported (ActiveKV owns the layout).");
  m.def("supports_attn_type", [](const std::string& t) { return t == "decoder"; }, py::arg("attn_type"),
        "True for decoder attention only.");
}
