// activekv._transfer: batched block copies between tiers (engine/include/activekv/transfer.h).
#include <activekv/transfer.h>
#include <activekv_py/common.h>

namespace py = pybind11;

PYBIND11_MODULE(_transfer, m) {
  m.doc() = "ActiveKV host <-> device transfers: batched block copies along dim 0.";
  activekv::py_glue::register_exceptions(m);
  m.def("copy_blocks", &activekv::copy_blocks, py::arg("src"), py::arg("dst"), py::arg("src_ids"), py::arg("dst_ids"),
        py::call_guard<py::gil_scoped_release>(),
        "dst[dst_ids[i]] = src[src_ids[i]] for every i, in one gather and one scatter; returns bytes copied.");
  m.def("copy_blocks_staged", &activekv::copy_blocks_staged, py::arg("src"), py::arg("dst"), py::arg("src_ids"),
        py::arg("dst_ids"), py::arg("copy_stream"), py::call_guard<py::gil_scoped_release>(),
        "copy_blocks from pinned CPU src to CUDA dst: CPU gather into pinned staging, one host-to-device copy on "
        "copy_stream (a torch.cuda.Stream), the current stream waits on it, then scatters. Returns bytes copied once "
        "queued. ValueError if src is not pinned CPU memory or dst is not on copy_stream's device.");
  m.def("copy_blocks_mapped", &activekv::copy_blocks_mapped, py::arg("src"), py::arg("dst"), py::arg("src_ids"),
        py::arg("dst_ids"), py::arg("copy_stream"), py::call_guard<py::gil_scoped_release>(),
        "copy_blocks from pinned CPU src to CUDA dst, read straight from pinned host memory on copy_stream: the copy "
        "engines (one cudaMemcpyBatchAsync of the runs of consecutive source blocks) where the runs average at least "
        "mapped_dma_min_bytes(), else one gather kernel (unified addressing; 16-byte loads when a block is a multiple "
        "of 16 bytes); the current stream waits on it, then scatters. Returns bytes copied once queued. Same errors "
        "as copy_blocks_staged, and ValueError if src or dst is not contiguous.");
  m.def("mapped_gather_ctas", &activekv::mapped_gather_ctas,
        "CTAs of copy_blocks_mapped's CUDA gather kernel at the next call (ACTIVEKV_GATHER_CTAS, 1..1024, or the "
        "default); 0 in a build without the kernel (copy_blocks_mapped then uses index_select).");
  m.def("mapped_dma_min_bytes", &activekv::mapped_dma_min_bytes,
        "Mean bytes per run of consecutive source blocks from which copy_blocks_mapped's next call uses the copy "
        "engines (ACTIVEKV_DMA_MIN_BYTES, 0 .. 2**50, or the default); -1 in a build without them (CUDA before 12.8, "
        "or no CUDA).");
  m.def("inline_ids_limit", &activekv::inline_ids_limit,
        "Most block ids a CUDA launch takes in its parameters rather than from an uploaded index at the next call: "
        "copy_blocks_mapped's gather and scatter, the engine's exact tiles (ACTIVEKV_INLINE_IDS, 0 .. 256, 0 uploads "
        "every index; or the default, 256).");
}
