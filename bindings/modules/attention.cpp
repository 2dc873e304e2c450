// activekv._attention: online-softmax tiled attention (engine/include/activekv/attention.h).
#include <activekv/attention.h>
#include <activekv/check.h>
#include <activekv/geometry.h>
#include <activekv_py/common.h>

namespace py = pybind11;

PYBIND11_MODULE(_attention, m) {
  m.doc() = "ActiveKV tiled attention: online softmax over tiles of blocks, GQA, causal prefill chunks and decode.";
  activekv::py_glue::register_exceptions(m);
  m.def("tiled_attention", &activekv::tiled_attention, py::arg("q"), py::arg("kv"), py::arg("seq_len"),
        py::arg("tile_blocks"), py::arg("scale"), py::call_guard<py::gil_scoped_release>(),
        "q [Lq, H, D], kv [nb, KVH, 2, bs, D] -> float32 [Lq, H, D]; the last Lq of seq_len positions attend "
        "causally.");
  // The engine calls these building blocks after tiled_attention/forward validated their inputs; exposed on their
  // own, they are entry points and check here (a zero divisor would otherwise be SIGFPE, not an exception).
  m.def(
      "group_query",
      [](const at::Tensor& q, int64_t num_kv_heads) {
        TORCH_CHECK_VALUE(q.dim() == 3, "q must be [num_q_tokens, num_heads, head_size], got ",
                          activekv::shape_str(q.sizes()));
        TORCH_CHECK_VALUE(q.size(1) > 0, "q must have num_heads > 0, got ", activekv::shape_str(q.sizes()));
        activekv::check_has_data(q, "q");
        TORCH_CHECK_VALUE(num_kv_heads > 0 && q.size(1) % num_kv_heads == 0, "num_heads (",
                          q.size(1), ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
        return activekv::group_query(q, num_kv_heads);
      },
      py::arg("q"), py::arg("num_kv_heads"), py::call_guard<py::gil_scoped_release>(),
      "[Lq, H, D] -> float32 [KVH, G * Lq, D]; ValueError unless H > 0 is a multiple of num_kv_heads.");
  m.def(
      "ungroup_output",
      [](const at::Tensor& out, int64_t num_q_tokens) {
        TORCH_CHECK_VALUE(out.dim() == 3, "out must be [num_kv_heads, group_size * num_q_tokens, head_size], got ",
                          activekv::shape_str(out.sizes()));
        TORCH_CHECK_VALUE(num_q_tokens > 0 && out.size(1) % num_q_tokens == 0, "out rows (", out.size(1),
                          ") must be a multiple of num_q_tokens (", num_q_tokens, ")");
        activekv::check_has_data(out, "out");
        return activekv::ungroup_output(out, num_q_tokens);
      },
      py::arg("out"), py::arg("num_q_tokens"), py::call_guard<py::gil_scoped_release>(),
      "[KVH, G * Lq, D] -> [Lq, H, D]; ValueError unless the rows are a multiple of num_q_tokens.");
  m.def(
      "tile_mask",
      [](int64_t first_query_pos, int64_t num_q_tokens, int64_t key_start, int64_t num_keys) {
        TORCH_CHECK_VALUE(num_q_tokens >= 0, "num_q_tokens must be >= 0, got ", num_q_tokens);
        TORCH_CHECK_VALUE(num_keys >= 0, "num_keys must be >= 0, got ", num_keys);
        int64_t end = 0;
        TORCH_CHECK_VALUE(!__builtin_add_overflow(first_query_pos, num_q_tokens, &end),
                          "first_query_pos + num_q_tokens must fit in int64, got ", first_query_pos, " + ",
                          num_q_tokens);
        TORCH_CHECK_VALUE(!__builtin_add_overflow(key_start, num_keys, &end),
                          "key_start + num_keys must fit in int64, got ", key_start, " + ", num_keys);
        return activekv::tile_mask(first_query_pos, num_q_tokens, key_start, num_keys, at::kCPU);
      },
      py::arg("first_query_pos"), py::arg("num_q_tokens"), py::arg("key_start"), py::arg("num_keys"),
      py::call_guard<py::gil_scoped_release>(), "bool [Lq, num_keys], True where key_pos > query_pos (masked); ValueError if a position range overflows int64.");
}
