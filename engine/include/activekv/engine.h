#pragma once
/// @file engine.h
/// @brief The engine: geometry + KV state + admission + transfers + tiled attention + telemetry, composed into the
///        three per-step entry points vLLM reaches (build, KV update, forward).
#include <activekv/admission.h>
#include <activekv/attention.h>
#include <activekv/geometry.h>
#include <activekv/kv_state.h>
#include <activekv/telemetry.h>
#include <activekv/transfer.h>

#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace activekv {

/// Which attention kernel computes each tile.
enum class Kernel : int {
  kAten = 0,    ///< the ATen tile path: the bit-exact path the Python reference mirrors
  kNative = 1,  ///< the fast kernel of the device (cpu_kernel.h on CPU, cuda_kernel.h on CUDA where built and the
                ///< shape is supported, else the ATen path): reads pool blocks in place; held to docs/parity.md
};

/// Kernel from its option spelling ("native" or "aten"). @throws c10::ValueError naming the valid kernels.
Kernel parse_kernel(const std::string& name);
/// Option spelling of a kernel.
const char* kernel_name(Kernel kernel);

/// How a tiered engine (pinned CPU host tier, CUDA pool) moves admitted blocks (transfer.h). Unused otherwise.
enum class Transfer : int {
  kMapped = 0,  ///< copy_blocks_mapped: one device gather kernel reading pinned host memory (the default)
  kStaged = 1,  ///< copy_blocks_staged: CPU gather into pinned staging, one host-to-device copy
};
/// Transfer from its option spelling ("mapped" or "staged"). @throws c10::ValueError naming the valid ones.
Transfer parse_transfer(const std::string& name);

/// Engine configuration, validated at construction.
struct EngineConfig {
  Geometry geometry;
  int64_t pool_blocks = 0;  ///< active-pool slots per layer, >= geometry.tile_blocks
  Mode mode = Mode::kExact;
  Kernel kernel = Kernel::kNative;  ///< kNative: the device's fast kernel (see Kernel)
  Transfer transfer = Transfer::kMapped;  ///< tiered engines only
  // Compressed mode only (see admission.h).
  int64_t budget_tokens = 2048;  ///< tokens a selecting decode row attends per KV head
  int64_t sink_blocks = 1;
  int64_t recent_blocks = 2;
};

/// Blocks a compressed-mode pool must hold for one request row: the union of every KV head's selection,
/// num_kv_heads * k + sink_blocks + recent_blocks. @throws c10::ValueError if the budget leaves k < 1.
int64_t worst_case_union_blocks(const EngineConfig& config);

/// One vLLM step's plan, shared by every layer of the step. CPU tensors, copied from vLLM's metadata.
struct StepPlan {
  at::Tensor query_start_loc;  ///< [num_reqs + 1] int32, cumulative query tokens per request row
  at::Tensor seq_lens;         ///< [num_reqs] int32, context length per row (computed + new tokens)
  at::Tensor block_table;      ///< [num_reqs, max_blocks] int32, vLLM physical block ids per row
  int64_t num_reqs = 0;
  int64_t num_actual_tokens = 0;  ///< query tokens that are real (rows past it are padding)
  int64_t build_id = 0;           ///< build counter value that made this plan
};

/// The engine. build, update_kv and forward serialise on a per-engine mutex, so one engine may be driven from several
/// threads (vLLM drives it from one); distinct instances are independent and run in parallel.
class Engine {
 public:
  /// @throws c10::ValueError if pool_blocks < tile_blocks or the geometry is invalid; in compressed mode also if
  ///         recent_blocks < 1, sink_blocks < 0, budget_tokens < (sink_blocks + recent_blocks + 1) * block_size, or
  ///         pool_blocks < worst_case_union_blocks.
  /// @param device the pool's device. On CPU the host tier (each layer's kv_cache) is CPU memory too. On a CUDA device
  ///        it is either that device's memory (resident) or pinned CPU memory (tiered: admitted blocks move
  ///        host-to-device on a copy stream, transfer.h; KV updates write the new tokens back to the host tier).
  Engine(EngineConfig config, at::Device device);

  const EngineConfig& config() const { return config_; }
  const Geometry& geometry() const { return config_.geometry; }
  at::Device device() const { return device_; }
  Telemetry& telemetry() { return telemetry_; }

  /// Inspection of one layer's state, each taken under the engine's lock and handed out as a copy: a caller never
  /// holds the engine's own tensors (which it could resize or swap) nor reads them while another thread's step
  /// changes them. @throws c10::IndexError for a layer outside [0, num_layers).
  /// (block id, pool slot) of every resident block, by block id.
  std::vector<std::pair<int64_t, int64_t>> resident(int64_t layer) const;
  /// The layer's pool [pool_blocks, num_kv_heads, 2, block_size, head_size], a copy.
  at::Tensor pool(int64_t layer) const;
  /// Per-block key minimum / maximum [host_blocks, num_kv_heads, head_size] in the KV dtype, copies; undefined before
  /// the layer's host tier is bound.
  at::Tensor key_min(int64_t layer) const;
  at::Tensor key_max(int64_t layer) const;
  /// Compressed mode, the layer's last forward: (request row, int64 [num_kv_heads, per_head] block ids), copies.
  std::vector<std::pair<int64_t, at::Tensor>> last_selection(int64_t layer) const;
  /// Which memory the layer's host tier is bound to, compared with kv_cache's (by data pointer).
  enum class HostBinding { kUnbound, kThis, kOther };
  HostBinding host_binding(int64_t layer, const at::Tensor& kv_cache) const;

  /// Assign layer names to layer indices, in order (vLLM's layer names of the KV-cache group).
  /// @throws c10::ValueError if the count differs from geometry.num_layers or a name repeats.
  void set_layer_names(const std::vector<std::string>& names);
  /// Layer index of a vLLM layer name. @throws c10::ValueError for an unknown name.
  int64_t layer_index(const std::string& name) const;

  /// Plan a step.
  /// @param query_start_loc [>= num_reqs + 1] integer, CPU, non-decreasing from 0
  /// @param seq_lens [>= num_reqs] integer, CPU
  /// @param block_table [>= num_reqs, max_blocks] integer, CPU
  /// @throws c10::ValueError / c10::TypeError naming the argument on any inconsistency.
  StepPlan build(const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
                 int64_t num_reqs, int64_t num_actual_tokens);

  /// KV update of one layer (vLLM's do_kv_cache_update).
  /// @param key, value [num_tokens, num_kv_heads, head_size], geometry dtype
  /// @param kv_cache the layer's host tier, see as_block_layout
  /// @param slot_mapping [n <= num_tokens] int64 (int32 accepted), -1 = padding
  void update_kv(int64_t layer, const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                 const at::Tensor& slot_mapping);

  /// Attention of one layer for a planned step, written into `output`.
  /// @param query [>= num_actual_tokens, num_heads, head_size], geometry dtype
  /// @param output [>= num_actual_tokens, num_heads, head_size] (or [.., num_heads * head_size]), query dtype;
  ///        rows of real tokens are overwritten, padding rows untouched
  void forward(int64_t layer, const StepPlan& plan, const at::Tensor& query, const at::Tensor& kv_cache,
               const at::Tensor& output, double scale);

  /// Count a forward entry that carried no metadata (vLLM warm-up): nothing else happens.
  void note_forward_skipped() { telemetry_.add(Counter::kForwardSkipped); }

  /// Compressed-mode selection parameters (k derived from the budget).
  const Selection& selection() const { return selection_; }

 private:
  void check_layer(int64_t layer) const;
  /// Compressed mode's selection of one decode row: [KVH, m] block positions (on the engine's device and on CPU),
  /// the union of the heads' blocks in position order; records the row's selection and the compressed counters.
  struct RowSelection {
    at::Tensor pos, pos_cpu;
    std::vector<int64_t> union_pos, union_blocks;
    /// Pool slot of every (head, selected block), [KVH * m], given the union's slots (in union order).
    std::vector<int64_t> head_slots(const std::vector<int64_t>& union_slots, int64_t kvh) const;
  };
  /// The scoring half of a row's selection: the row's block ids (CPU int64 [nb]) and the chosen [KVH, m] positions
  /// (on the engine's device). Reads the layer's key metadata only, records nothing: plan_rows may run it for several
  /// rows at once (one row per task).
  struct RowChoice {
    at::Tensor row_blocks, pos;
  };
  RowChoice choose_row(const LayerState& L, const int32_t* row, int64_t nb, const at::Tensor& q) const;
  /// The recording half: the union, the layer's last selection and the compressed counters of request row r.
  RowSelection select_row(LayerState& L, const int32_t* row, int64_t r, const RowChoice& choice);
  /// A request row of a forward that has query tokens, planned once for every kernel path (plan_rows): its query per
  /// KV head, its online-softmax state and its admission units in the order they are admitted (an exact row: its
  /// tiles of tile_blocks blocks; a compressed decode row: one unit, the union of its heads' selections).
  struct RowWork {
    int64_t q0 = 0, lq = 0, seq = 0;
    at::Tensor qg;  ///< [KVH, G * lq, D] float32 from group_query (contiguous where a kernel reads it by pointer);
                    ///< undefined with the CPU kernel (forward_native)
    OnlineSoftmax st;  ///< likewise
    std::optional<RowSelection> sel;          ///< compressed decode rows only
    std::vector<std::vector<int64_t>> tiles;  ///< exact rows: block ids of each tile; empty for a compressed row
    size_t num_units() const { return sel ? 1 : tiles.size(); }
    /// Block ids of admission unit u < num_units(): the selection's union (compressed row), else tile u.
    const std::vector<int64_t>& unit(size_t u) const { return sel ? sel->union_blocks : tiles[u]; }
  };
  std::vector<RowWork> plan_rows(LayerState& L, const StepPlan& plan, const at::Tensor& query);
  /// Admit one unit's blocks: admit_tile, the slots appended to `pinned` (the caller's pins, released even if the copy
  /// throws), the missing blocks copied from the host tier, the admission counters added. @return the unit's slots
  std::vector<int64_t> admit_unit(LayerState& L, const at::Tensor& host, const std::vector<int64_t>& blocks,
                                  std::vector<int64_t>& pinned);
  /// The ATen / CUDA paths' compute of one admitted unit: exact tile `tile` of the row, or the row's selection.
  void attend_tile(LayerState& L, RowWork& w, int64_t tile, const std::vector<int64_t>& slots, double scale);
  void attend_selected(LayerState& L, RowWork& w, const std::vector<int64_t>& union_slots, double scale);
  /// Every row of a forward with the CPU kernel (engine.cpp): admission units in request order while they fit the
  /// pool together, one kernel call (one parallel region) per round over all (row, KV head) tasks.
  /// The rows' grouped queries and online-softmax state live in buffers of its own (RowWork::qg / st stay undefined),
  /// and it writes every row's output into out3 [tokens, heads, D] itself.
  void forward_native(LayerState& L, const at::Tensor& host, const at::Tensor& query, std::vector<RowWork>& rows,
                      const at::Tensor& out3, double scale);
  /// The CUDA kernel (cuda_kernel.h) for a tile: slots[h * n + j] is the pool slot of head h's j-th block, at row
  /// position pos[h * n + j].
  void cuda_tile(LayerState& L, const std::vector<int64_t>& slots, const std::vector<int64_t>& pos, int64_t n,
                 int64_t first_query_pos, int64_t lq, const at::Tensor& qg, OnlineSoftmax& st, double scale);
  bool use_native() const { return config_.kernel == Kernel::kNative && device_.is_cpu(); }
  /// kNative on CUDA: the CUDA kernel when it is built and supports the head size and rows (G * query tokens).
  bool use_cuda_kernel(int64_t rows) const;

  EngineConfig config_;
  at::Device device_;
  KVState kv_;
  Telemetry telemetry_;
  Selection selection_;
  uint64_t clock_ = 0;
  std::unordered_map<std::string, int64_t> layer_names_;
  std::optional<c10::Stream> copy_stream_;  ///< CUDA pool only: host-to-device copies of a pinned host tier
  mutable std::mutex mu_;
};

/// Engine version string and the torch version it was built against.
const char* engine_version();
const char* engine_torch_version();

}  // namespace activekv
