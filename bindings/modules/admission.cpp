// activekv._admission: which blocks enter the active pool and which leave it (engine/include/activekv/admission.h).
#include <activekv/admission.h>
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
    layer.last_use.assign(pool_blocks, 0);
    layer.pins.assign(pool_blocks, 0);
  }
  activekv::LayerState layer;
  uint64_t clock = 0;
};
}  // namespace

PYBIND11_MODULE(_admission, m) {
  m.doc() = "ActiveKV admission policy (exact mode): tiles of a row's blocks, LRU eviction of unpinned slots.";
  activekv::py_glue::register_exceptions(m);
  py::enum_<activekv::Mode>(m, "Mode", "Admission modes.").value("EXACT", activekv::Mode::kExact);
  m.def("parse_mode", &activekv::parse_mode, py::arg("name"), "Mode from its option spelling; ValueError if unknown.");
  m.def(
      "exact_tiles",
      [](const at::Tensor& block_row, int64_t num_blocks, int64_t tile_blocks) {
        TORCH_CHECK_TYPE(block_row.scalar_type() == at::kInt && block_row.dim() == 1 && block_row.is_contiguous(),
                         "block_row must be a contiguous 1-D int32 tensor, got ", block_row.scalar_type(), " ",
                         block_row.sizes());
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
