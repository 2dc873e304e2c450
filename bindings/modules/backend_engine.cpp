// activekv._backend, the engine half: the Engine class (engine/include/activekv/engine.h) and the StepPlan its build
// returns, for the tools, tests and benchmarks that drive an engine directly. The vLLM-facing objects are backend.cpp.
#include <activekv/engine.h>
#include <activekv_py/common.h>
#include <activekv_py/backend_parts.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace activekv::py_glue {

void register_engine(py::module_& m) {
  py::class_<PlanHandle>(m, "StepPlan", "One vLLM step's plan (the attention metadata every layer's forward gets).")
      .def_property_readonly("num_reqs", [](const PlanHandle& p) { return p.plan.num_reqs; })
      .def_property_readonly("num_actual_tokens", [](const PlanHandle& p) { return p.plan.num_actual_tokens; })
      .def_property_readonly("query_start_loc", [](const PlanHandle& p) { return p.plan.query_start_loc.clone(); },
                             "int32 [num_reqs + 1], a copy (the plan's own tensors cannot be changed after build).")
      .def_property_readonly("seq_lens", [](const PlanHandle& p) { return p.plan.seq_lens.clone(); },
                             "int32 [num_reqs], a copy.")
      .def_property_readonly("block_table", [](const PlanHandle& p) { return p.plan.block_table.clone(); },
                             "int32 [num_reqs, max_blocks], a copy.");

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine",
                                               "The ActiveKV engine: host tier + active pool + admission + tiled "
                                               "attention + telemetry, for num_layers layers.")
      .def(py::init([](int64_t num_layers, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                       int64_t block_size, at::ScalarType dtype, int64_t pool_blocks, int64_t tile_blocks,
                       at::Device device, const std::string& mode, int64_t budget_tokens, int64_t sink_blocks,
                       int64_t recent_blocks, const std::string& kernel, const std::string& transfer,
                       const std::string& placement, int64_t dense_layers) {
             EngineConfig cfg;
             cfg.geometry = Geometry(num_layers, num_heads, num_kv_heads, head_size, block_size, dtype,
                                               tile_blocks);
             cfg.pool_blocks = pool_blocks;
             cfg.mode = parse_mode(mode);
             cfg.budget_tokens = budget_tokens;
             cfg.sink_blocks = sink_blocks;
             cfg.recent_blocks = recent_blocks;
             cfg.kernel = parse_kernel(kernel);
             cfg.transfer = parse_transfer(transfer);
             cfg.placement = parse_placement(placement);
             cfg.dense_layers = dense_layers;
             return std::make_shared<Engine>(cfg, device);
           }),
           py::arg("num_layers"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_size"),
           py::arg("block_size"), py::arg("dtype"), py::arg("pool_blocks"), py::arg("tile_blocks"),
           py::arg("device") = at::Device("cpu"), py::arg("mode") = "exact", py::arg("budget_tokens") = 2048,
           py::arg("sink_blocks") = 1, py::arg("recent_blocks") = 2, py::arg("kernel") = "native",
           py::arg("transfer") = "mapped", py::arg("placement") = "pool",
           py::arg("dense_layers") = 0,
           "mode 'exact' or 'compressed' (budget_tokens, sink_blocks, recent_blocks, dense_layers apply to compressed "
           "mode; the first dense_layers layers attend every block); kernel "
           "'native' (fast CPU kernel) or 'aten' (the bit-exact ATen tile path the reference mirrors). device: the "
           "pool's device; on CUDA each layer's kv_cache is device memory (resident) or pinned CPU memory (tiered), "
           "and transfer picks how a tiered engine admits blocks: 'mapped' (a device gather reading pinned host "
           "memory) or 'staged' (CPU gather into pinned staging, one host-to-device copy). placement 'pool' (blocks "
           "admitted into the active pool, copied on a miss) or 'in_place' (pool_blocks 0: blocks read where they are in "
           "each layer's kv_cache, nothing admitted or copied; on CUDA the kv_cache must be device memory).")
      .def(
          "build",
          [](const std::shared_ptr<Engine>& e, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
             const at::Tensor& block_table, int64_t num_reqs, int64_t num_actual_tokens,
             std::optional<at::Tensor> slot_mapping) {
            TORCH_CHECK_VALUE(seq_lens.dim() == 1, "seq_lens must be 1-D [num_reqs], got ", seq_lens.sizes());
            PlanHandle h{e, {}};
            {
              py::gil_scoped_release release;
              h.plan = e->build(query_start_loc, seq_lens, block_table, num_reqs, num_actual_tokens,
                                slot_mapping.value_or(at::Tensor()));
            }
            return h;
          },
          py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_table"), py::arg("num_reqs"),
          py::arg("num_actual_tokens"), py::arg("slot_mapping") = py::none(),
          "Plan a step from int32/int64 CPU tensors: query_start_loc [>= num_reqs + 1], seq_lens [>= num_reqs], "
          "block_table [>= num_reqs, W]; num_actual_tokens real query tokens (the engine's build, same order). "
          "slot_mapping (optional): the step's, as its KV updates get it; on a CUDA engine, a tensor on its device is "
          "checked once here so that the updates need not copy it to the host.")
      .def("update_kv", &Engine::update_kv, py::arg("layer"), py::arg("key"), py::arg("value"), py::arg("kv_cache"),
           py::arg("slot_mapping"), py::call_guard<py::gil_scoped_release>(),
           "Write key/value [T, KVH, D] into the layer's KV cache at slot_mapping [n <= T] (-1 = padding).")
      .def(
          "forward",
          [](const std::shared_ptr<Engine>& e, int64_t layer, const PlanHandle& plan, const at::Tensor& query,
             const at::Tensor& kv_cache, const at::Tensor& output, double scale) {
            TORCH_CHECK_VALUE(plan.engine == e, "plan was built by another ActiveKV engine");
            py::gil_scoped_release release;
            e->forward(layer, plan.plan, query, kv_cache, output, scale);
          },
          py::arg("layer"), py::arg("plan"), py::arg("query"), py::arg("kv_cache"), py::arg("output"),
          py::arg("scale"), "Attention for the planned step: query [T, H, D] -> output [T, H, D] (written in place).")
      .def("snapshot", [](Engine& e) { return snapshot_to_dict(e.telemetry().snapshot()); },
           "This engine's counters, histograms and info.")
      .def("reset_telemetry", [](Engine& e) { e.telemetry().reset(); }, "Zero this engine's counters/histograms.")
      .def("layer_index", &Engine::layer_index, py::arg("name"), "Layer index of a vLLM layer name.")
      .def(
          "resident",
          [](Engine& e, int64_t layer) {
            std::vector<std::pair<int64_t, int64_t>> blocks;
            {
              py::gil_scoped_release release;
              blocks = e.resident(layer);
            }
            py::dict d;
            for (const auto& [block, slot] : blocks) d[py::int_(block)] = slot;
            return d;
          },
          py::arg("layer"), "{block id: pool slot} of the layer's resident blocks.")
      .def("pool", &Engine::pool, py::arg("layer"), py::call_guard<py::gil_scoped_release>(),
           "A copy of the layer's active pool [pool_blocks, num_kv_heads, 2, block_size, head_size].")
      .def("key_min", &Engine::key_min, py::arg("layer"), py::call_guard<py::gil_scoped_release>(),
           "A copy of the per-block key minimum [num_blocks, num_kv_heads, head_size] in the KV dtype; None before "
           "the layer's first KV update and in exact mode (which keeps no key metadata).")
      .def("key_max", &Engine::key_max, py::arg("layer"), py::call_guard<py::gil_scoped_release>(),
           "A copy of the per-block key maximum [num_blocks, num_kv_heads, head_size] in the KV dtype; None before "
           "the layer's first KV update and in exact mode (which keeps no key metadata).")
      .def(
          "selection",
          [](Engine& e, int64_t layer) {
            std::vector<std::pair<int64_t, at::Tensor>> rows;
            {
              py::gil_scoped_release release;
              rows = e.last_selection(layer);
            }
            py::dict d;
            for (const auto& [row, ids] : rows) d[py::int_(row)] = ids;
            return d;
          },
          py::arg("layer"),
          "Compressed mode, the layer's last forward: {request row: int64 [num_kv_heads, per_head] block ids each KV "
          "head attended} (copies); rows that ran exactly are absent.")
      .def_property_readonly("top_k", [](Engine& e) { return e.selection().top_k; },
                             "Blocks chosen per KV head by score (compressed mode).")
      .def_property_readonly("num_layers", [](Engine& e) { return e.geometry().num_layers; })
      .def_property_readonly("pool_blocks", [](Engine& e) { return e.config().pool_blocks; })
      .def_property_readonly("tile_blocks", [](Engine& e) { return e.geometry().tile_blocks; })
      .def_property_readonly("block_size", [](Engine& e) { return e.geometry().block_size; })
      .def_property_readonly("mode", [](Engine& e) { return std::string(mode_name(e.config().mode)); })
      .def_property_readonly("kernel",
                             [](Engine& e) { return std::string(kernel_name(e.config().kernel)); })
      .def_property_readonly("placement",
                             [](Engine& e) { return std::string(placement_name(e.config().placement)); });
}

}  // namespace activekv::py_glue
