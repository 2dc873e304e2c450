// activekv._admission: which blocks enter the active pool and which leave it (engine/include/activekv/admission.h).
#include <activekv/admission.h>
#include <activekv/selection.h>
#include <activekv/check.h>
#include <activekv_py/common.h>

namespace py = pybind11;

namespace {
// A page table without tensors: exercises the admission policy on its own.
struct PagePool {
  PagePool(int64_t pool_blocks, int64_t host_blocks) {
    TORCH_CHECK_VALUE(pool_blocks >= 1, "pool_blocks must be >= 1, got ", pool_blocks);
    TORCH_CHECK_VALUE(host_blocks >= 0, "host_blocks must be >= 0, got ", host_blocks);
    layer.host_blocks = host_blocks;
    layer.slot_of_block.assign(host_blocks, -1);
    layer.block_of_slot.assign(pool_blocks, -1);
    activekv::reset_page_table(layer);
  }
  activekv::LayerState layer;
  uint64_t clock = 0;
};
// The inputs of a Quest bound, checked once for select_blocks and quest_scores: q [1, H, D] with data, key_min/max
// [blocks, KVH, D] matching it, both float32, bfloat16 or float16, `ids` (row_blocks or ids) 1-D int64 in
// [0, blocks), all on q's device, CPU for the native kernel.
void check_quest_inputs(const at::Tensor& q, const at::Tensor& key_min, const at::Tensor& key_max, const at::Tensor& ids,
                        const char* ids_name, bool native) {
  TORCH_CHECK_VALUE(q.dim() == 3 && q.size(0) == 1, "q must be [1, num_heads, head_size], got ", q.sizes());
  TORCH_CHECK_VALUE(q.size(1) > 0, "q must have num_heads > 0, got ", q.sizes());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"q", &q}, {"key_min", &key_min},
                                {"key_max", &key_max}, {ids_name, &ids}}) {
    activekv::check_has_data(*t, name);
    TORCH_CHECK_VALUE(t->device() == q.device(), name, " must be on q's device ", q.device(), ", got ", t->device());
  }
  const auto dt = key_min.scalar_type();
  TORCH_CHECK_TYPE((dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) && key_max.scalar_type() == dt,
                   "key_min and key_max must both be float32, bfloat16 or float16, got ", key_min.scalar_type(),
                   " and ", key_max.scalar_type());
  TORCH_CHECK_VALUE(key_min.dim() == 3 && key_min.sizes() == key_max.sizes() && key_min.size(2) == q.size(2) &&
                        key_min.size(1) > 0 && q.size(1) % key_min.size(1) == 0,
                    "key_min/key_max must be [blocks, num_kv_heads, head_size] matching q, got ", key_min.sizes(),
                    " and ", key_max.sizes());
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong && ids.dim() == 1, ids_name, " must be a 1-D int64 tensor, got ",
                   ids.scalar_type(), " ", ids.sizes());
  TORCH_CHECK_VALUE(!native || q.is_cpu(), "the native Quest kernel needs CPU tensors, got q on ", q.device());
  if (ids.numel() > 0) {
    const auto lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    TORCH_CHECK_INDEX(lo >= 0 && hi < key_min.size(0), ids_name, " must be in [0, ", key_min.size(0), "), got [", lo,
                      ", ", hi, "]");
  }
}
}  // namespace

PYBIND11_MODULE(_admission, m) {
  m.doc() = "ActiveKV admission policy: exact tiles, LRU eviction of unpinned slots, compressed-mode block selection.";
  activekv::py_glue::register_exceptions(m);
  m.def(
      "select_blocks",
      [](const at::Tensor& q, const at::Tensor& key_min, const at::Tensor& key_max, const at::Tensor& row_blocks,
         int64_t sink_blocks, int64_t recent_blocks, int64_t top_k, bool native_scores) {
        check_quest_inputs(q, key_min, key_max, row_blocks, "row_blocks", native_scores);
        activekv::check_selection(activekv::Selection{sink_blocks, recent_blocks, top_k});
        const auto kmin = native_scores ? key_min.contiguous() : key_min;
        const auto kmax = native_scores ? key_max.contiguous() : key_max;
        return activekv::select_blocks(q, kmin, kmax, row_blocks,
                                       activekv::Selection{sink_blocks, recent_blocks, top_k}, native_scores);
      },
      py::arg("q"), py::arg("key_min"), py::arg("key_max"), py::arg("row_blocks"), py::arg("sink_blocks"),
      py::arg("recent_blocks"), py::arg("top_k"), py::arg("native_scores") = false,
      py::call_guard<py::gil_scoped_release>(),
      "Quest selection of one decode row: int64 [num_kv_heads, sink + top_k + recent] block positions, ascending. "
      "native_scores=True scores with the CPU kernel (the engine's path with kernel 'native'), else with the ATen "
      "ops the reference repeats.");
  m.def(
      "quest_scores",
      [](const at::Tensor& q, const at::Tensor& key_min, const at::Tensor& key_max, const at::Tensor& ids,
         bool native) {
        check_quest_inputs(q, key_min, key_max, ids, "ids", native);
        return native ? activekv::quest_scores_native(q, key_min.contiguous(), key_max.contiguous(), ids)
                      : activekv::quest_scores(q, key_min, key_max, ids);
      },
      py::arg("q"), py::arg("key_min"), py::arg("key_max"), py::arg("ids"), py::arg("native") = false,
      py::call_guard<py::gil_scoped_release>(),
      "Quest bound of blocks ids for every KV head: float32 [num_kv_heads, len(ids)]; native=True: the CPU kernel.");
  // A mode is its option spelling everywhere in Python (Engine(mode=...), Engine.mode, additional_config).
  m.def(
      "parse_mode", [](const std::string& name) { return std::string(activekv::mode_name(activekv::parse_mode(name))); },
      py::arg("name"), "The mode's option spelling, 'exact' or 'compressed', checked; ValueError for any other str.");
  m.def(
      "exact_tiles",
      [](const at::Tensor& block_row, int64_t num_blocks, int64_t tile_blocks) {
        TORCH_CHECK_TYPE(block_row.scalar_type() == at::kInt && block_row.dim() == 1 && block_row.is_contiguous(),
                         "block_row must be a contiguous 1-D int32 tensor, got ", block_row.scalar_type(), " ",
                         block_row.sizes());
        activekv::check_has_data(block_row, "block_row");
        TORCH_CHECK_VALUE(block_row.device().is_cpu(), "block_row must be on cpu, got ", block_row.device());
        TORCH_CHECK_VALUE(num_blocks >= 0 && num_blocks <= block_row.size(0), "num_blocks must be in [0, ",
                          block_row.size(0), "], got ", num_blocks);
        TORCH_CHECK_VALUE(tile_blocks >= 1, "tile_blocks must be >= 1, got ", tile_blocks);
        return activekv::exact_tiles(block_row.data_ptr<int32_t>(), num_blocks, tile_blocks);
      },
      py::arg("block_row"), py::arg("num_blocks"), py::arg("tile_blocks"),
      "The first num_blocks ids of a block-table row, tile_blocks at a time.");
  py::class_<PagePool>(m, "PagePool", "One layer's page table: pool slots <-> vLLM physical block ids.")
      .def(py::init<int64_t, int64_t>(), py::arg("pool_blocks"), py::arg("host_blocks"))
      .def(
          "admit",
          [](PagePool& p, const std::vector<int64_t>& blocks) {
            auto a = activekv::admit_tile(p.layer, blocks, p.clock);
            py::dict d;
            d["slots"] = a.slots;
            d["miss_blocks"] = a.miss_blocks;
            d["miss_slots"] = a.miss_slots;
            d["hits"] = a.hits;
            d["evicted"] = a.evicted;
            return d;
          },
          py::arg("blocks"), "Admit and pin a tile's blocks: {slots, miss_blocks, miss_slots, hits, evicted}.")
      .def(
          "release",
          [](PagePool& p, const std::vector<int64_t>& slots) {
            // Count repeats: a slot listed k times needs k pins, else release_tile's invariant fails half-way.
            std::vector<int32_t> pins = p.layer.pins;
            for (int64_t s : slots) {
              TORCH_CHECK_VALUE(s >= 0 && s < static_cast<int64_t>(pins.size()) && pins[s] > 0, "slot ", s,
                                " is not a pinned pool slot");
              --pins[s];
            }
            activekv::release_tile(p.layer, slots);
          },
          py::arg("slots"), "Unpin a tile's slots; ValueError for a slot that is not pinned.")
      .def(
          "resident",
          [](const PagePool& p) { return activekv::py_glue::resident_dict(p.layer); },
          "{block id: pool slot} of resident blocks.");
}
