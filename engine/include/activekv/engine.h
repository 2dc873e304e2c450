#pragma once
/// @file engine.h
/// @brief The engine: its configuration and the three per-step entry points vLLM reaches (build, KV update, forward),
///        composed from the parts: the step plan (step_plan.h), KV state (kv_state.h), admission (admission.h),
///        compressed selection (selection.h), transfers (transfer.h), the forward path chosen once per engine (the
///        ATen tile path of attention.h, or the device's kernel: cpu_kernel.h, cuda_kernel.h) and telemetry.
///
/// A step: build checks vLLM's metadata and plans everything that is the same for every layer (StepPlan); each layer's
/// KV update writes the new tokens; each layer's forward checks its inputs, selects (compressed mode), admits units of
/// blocks into the layer's pool round by round and has its path compute them.
#include <activekv/admission.h>
#include <activekv/attention.h>
#include <activekv/geometry.h>
#include <activekv/kv_state.h>
#include <activekv/selection.h>
#include <activekv/step_plan.h>
#include <activekv/telemetry.h>
#include <activekv/transfer.h>

#include <c10/core/Event.h>

#include <limits>
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

/// Where a forward reads the blocks it attends.
enum class Placement : int {
  kPool = 0,     ///< admitted into the engine's active pool (copied from the host tier on a miss), read there
  kInPlace = 1,  ///< read where they are in the host tier (vLLM's KV cache): no pool, no admission, no copy. On the
                 ///< CPU, or on a CUDA device whose host tier is its own memory (a pool would be the same memory)
};
/// Placement from its option spelling ("pool" or "in_place"). @throws c10::ValueError naming the valid ones.
Placement parse_placement(const std::string& name);
/// Option spelling of a placement.
const char* placement_name(Placement placement);

/// Engine configuration, validated at construction.
struct EngineConfig {
  Geometry geometry;
  int64_t pool_blocks = 0;  ///< active-pool slots per layer, >= geometry.tile_blocks (in place: 0, no pool)
  Placement placement = Placement::kPool;
  Mode mode = Mode::kExact;
  Kernel kernel = Kernel::kNative;  ///< kNative: the device's fast kernel (see Kernel)
  Transfer transfer = Transfer::kMapped;  ///< tiered engines only
  // Compressed mode only (see selection.h).
  int64_t budget_tokens = 2048;  ///< tokens a selecting decode row attends per KV head
  int64_t sink_blocks = 1;
  int64_t recent_blocks = 2;
  /// The first dense_layers layers attend every block of every row, as exact mode (Quest keeps its first two layers
  /// dense: their attention is spread, so no budget captures it); in [0, geometry.num_layers].
  int64_t dense_layers = 0;
};

/// Blocks a compressed-mode pool must hold for one request row: the union of every KV head's selection,
/// num_kv_heads * k + sink_blocks + recent_blocks. @throws c10::ValueError if the budget leaves k < 1.
int64_t worst_case_union_blocks(const EngineConfig& config);

/// The Engine constructor's checks of `config` for an engine on `device` (its type is what counts), allocating
/// nothing: a configuration can be checked before anything is built.
/// @throws c10::ValueError as Engine's constructor, except the pools' size against memory (check_pools_fit_memory,
///         which the KV state runs before it allocates and the options' check runs by the option's name).
void check_engine_config(const EngineConfig& config, at::Device device);

class ForwardPath;  // forward_path.h (private to the engine)

/// The engine. build, update_kv and forward serialise on a per-engine mutex, so one engine may be driven from several
/// threads (vLLM drives it from one); distinct instances are independent and run in parallel.
class Engine {
 public:
  /// @throws c10::ValueError if the geometry is invalid; with a pool if pool_blocks < tile_blocks; in place if the
  ///         device is neither the CPU nor CUDA or pool_blocks is not 0; in compressed mode also if recent_blocks < 1,
  ///         sink_blocks < 0, budget_tokens < (sink_blocks + recent_blocks + 1) * block_size, dense_layers outside
  ///         [0, num_layers], or (with a pool) pool_blocks < worst_case_union_blocks; on the CPU if the pools exceed
  ///         the machine's physical memory (KVState's check_pools_fit_memory, geometry.h, before it allocates).
  /// @param device the pool's device. On CPU the host tier (each layer's kv_cache) is CPU memory too. On a CUDA device
  ///        it is either that device's memory (resident; in place it must be) or pinned CPU memory (tiered: admitted
  ///        blocks move host-to-device on a copy stream, transfer.h; KV updates write the new tokens back to the host
  ///        tier).
  Engine(EngineConfig config, at::Device device);
  ~Engine();

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
  /// the layer's host tier is bound, and in exact mode, which keeps no key metadata.
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
  /// Whether this engine serves vLLM layer `name`.
  bool serves_layer(const std::string& name) const;

  /// Plan a step (step_plan.h plan_step): its metadata checked, its rows, block ids and admission units planned, and
  /// the admission rounds of the engine's path where they do not depend on a layer.
  /// @param query_start_loc [>= num_reqs + 1] integer, CPU, non-decreasing from 0
  /// @param seq_lens [>= num_reqs] integer, CPU
  /// @param block_table [>= num_reqs, max_blocks] integer, CPU
  /// @param slot_mapping optional: the step's slot mapping, as the layers' KV updates will get it. On a CUDA engine
  ///        with the tensor on its device, its entries are copied to the host and checked here, once for the step
  ///        (kv_state.h CheckedSlots), so that each layer's update reads them on the device only.
  /// @throws c10::ValueError / c10::TypeError naming the argument on any inconsistency; c10::Error (RuntimeError)
  ///         when a CUDA KV update since the last build found a slot outside the KV cache on the device (a slot
  ///         mapping changed after its check).
  StepPlan build(const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
                 int64_t num_reqs, int64_t num_actual_tokens, const at::Tensor& slot_mapping = at::Tensor());

  /// KV update of one layer (vLLM's do_kv_cache_update).
  /// @param key, value [num_tokens, num_kv_heads, head_size], geometry dtype
  /// @param kv_cache the layer's host tier, see as_block_layout
  /// @param slot_mapping [n <= num_tokens] int64 (int32 accepted), -1 = padding
  /// On CUDA with the CUDA kernel built the write is ordered on the current stream and does not wait for it
  /// (KVState::write): a pinned host tier holds the tokens once the stream has run them.
  void update_kv(int64_t layer, const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                 const at::Tensor& slot_mapping);

  /// Attention of one layer for a planned step, written into `output`. The plan's block ids are checked against
  /// kv_cache's block count (one comparison: check_plan_blocks) before anything changes. On CUDA the plan's exact
  /// decode rows take one launch (StepPlan::batch) where every block they read is on the device.
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
  /// In place, the host tier must be the engine's device's memory. @throws c10::ValueError
  void check_in_place_host(const at::Tensor& host) const;
  bool in_place() const { return config_.placement == Placement::kInPlace; }
  /// Blocks a round of a batching path may hold: the pool's slots, or (in place, nothing admitted) no limit.
  int64_t round_capacity() const {
    return in_place() ? std::numeric_limits<int64_t>::max() : config_.pool_blocks;
  }
  /// Admit one unit's blocks: admit_tile, the slots appended to `pinned` (the caller's pins, released even if the copy
  /// throws), the missing blocks copied from the host tier, the admission counters added. @return the unit's slots
  std::vector<int64_t> admit_unit(LayerState& L, const at::Tensor& host, UnitBlocks blocks,
                                  std::vector<int64_t>& pinned);
  /// The copy stream where `host` is a tiered host tier (pinned CPU memory behind a CUDA pool), else nullptr.
  const c10::Stream* tier_stream(const at::Tensor& host) const {
    return copy_stream_.has_value() && host.is_cpu() ? &*copy_stream_ : nullptr;
  }

  EngineConfig config_;
  at::Device device_;
  KVState kv_;
  Telemetry telemetry_;
  Telemetry dense_plan_counts_{false};  ///< what planning a step's dense-layer plan counts (not reported)
  Selection selection_;
  uint64_t clock_ = 0;
  std::unordered_map<std::string, int64_t> layer_names_;
  std::optional<c10::Stream> copy_stream_;  ///< CUDA pool only: host-to-device copies of a pinned host tier
  /// CUDA: recorded on the compute stream after each KV update of a pinned host tier; the copy stream waits for it
  /// (its gathers read the host tier), and the staged transfer's CPU gather synchronises with it while pending.
  std::optional<c10::Event> host_written_;
  bool host_write_pending_ = false;
  CheckedSlots step_slots_;  ///< the last build's checked slot mapping (CUDA), trusted by the step's KV updates
  std::unique_ptr<ForwardPath> path_;        ///< chosen at construction (forward_path.h make_forward_path)
  int64_t resident_blocks_ = 0;              ///< occupied pool slots summed over layers (the gauge), kept by deltas
  mutable std::mutex mu_;
};

/// Engine version string and the torch version it was built against.
const char* engine_version();
const char* engine_torch_version();

}  // namespace activekv
