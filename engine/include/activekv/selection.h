#pragma once
/// @file selection.h
/// @brief Compressed mode's selection: which blocks a decode row attends per KV head, and the record of it.
///
/// Compressed mode (decode rows whose context exceeds the budget): per KV head, the first `sink_blocks` blocks, the
/// last `recent_blocks` blocks and the top `k` of the others by a query-aware upper bound of q.k, where
/// k = floor(budget_tokens / block_size) - sink_blocks - recent_blocks. The bound is Quest's page-criticality estimate
/// (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024): for each
/// dimension the larger of q_d * min_d and q_d * max_d, summed, i.e. relu(q) . max + min(q, 0) . min, computed as two
/// batched matmuls (or, with the native kernel on CPU, by the fused kernel of cpu_kernel.h reading the metadata in
/// place). GQA: a KV head scores a block by the maximum of its query heads' bounds. Ties break by lowest block index:
/// the chosen set is the one a stable descending sort would take first, found with one partial top-k (`at::topk`) for
/// the k-th score, then every block above it and the lowest-positioned blocks equal to it (the native path: one
/// std::nth_element on (score, position) pairs, the same set). The pool admits the union of the heads' blocks
/// (admission.h); each head attends only to its own. Prefill rows and rows within the budget run exactly as exact
/// mode (step_plan.h decides which rows select).
#include <activekv/kv_state.h>
#include <activekv/step_plan.h>
#include <activekv/telemetry.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace activekv {

/// Compressed-mode selection parameters, validated by the engine's configuration.
struct Selection {
  int64_t sink_blocks = 1;    ///< first blocks of every context, always attended
  int64_t recent_blocks = 2;  ///< last blocks of every context (the query's own block among them), always attended
  int64_t top_k = 1;          ///< blocks chosen per KV head from the rest by the Quest bound
  /// Blocks a selecting row attends per KV head.
  int64_t per_head() const { return sink_blocks + top_k + recent_blocks; }
};

/// Counts a selection takes, at most 2^40 each (so their sums and products with a geometry's sizes stay in int64).
constexpr int64_t kMaxSelectionCount = int64_t{1} << 40;

/// @throws c10::ValueError unless sink_blocks is in [0, 2^40], recent_blocks and top_k in [1, 2^40].
void check_selection(const Selection& sel);

/// Select the blocks of one decode row, per KV head.
/// @param q [1, num_heads, head_size] the row's query (any float dtype; scored in float32)
/// @param key_min, key_max [host_blocks, num_kv_heads, head_size] per-block key metadata of the layer, float32,
///        bfloat16 or float16 (both the same; the engine keeps it in the KV dtype), widened exactly to float32
/// @param row_blocks [num_blocks] int64 the row's block ids in position order, num_blocks > sel.per_head()
/// @param native_scores score with the CPU kernel (quest_scores_native; key metadata on CPU, contiguous) and take
///        the top k per head with std::nth_element (the set top_blocks takes), instead of the ATen ops the reference
///        repeats (quest_scores, top_blocks)
/// @return [num_kv_heads, sel.per_head()] int64 block positions (indices into row_blocks), ascending per head
/// @throws c10::ValueError if num_blocks <= sel.per_head()
at::Tensor select_blocks(const at::Tensor& q, const at::Tensor& key_min, const at::Tensor& key_max,
                         const at::Tensor& row_blocks, const Selection& sel, bool native_scores = false);

/// Quest bound of candidate blocks with ATen ops: [num_kv_heads, C] float32 for q [1, num_heads, head_size] and
/// ids [C] int64 block ids (rows of key_min / key_max). The bit-exact path the reference repeats.
at::Tensor quest_scores(const at::Tensor& q, const at::Tensor& key_min, const at::Tensor& key_max,
                        const at::Tensor& ids);

/// The same bound computed by the CPU kernel (cpu_kernel.h QuestArgs), reading key_min / key_max in place: equal to
/// quest_scores within float32 rounding (a different summation order). CPU, contiguous metadata of one of the dtypes
/// select_blocks takes.
at::Tensor quest_scores_native(const at::Tensor& q, const at::Tensor& key_min, const at::Tensor& key_max,
                               const at::Tensor& ids);

/// Positions of the k highest scores per row of score [num_kv_heads, C], ties by lowest position, ascending:
/// [num_kv_heads, k] int64. NaN ranks as +inf.
at::Tensor top_blocks(const at::Tensor& score, int64_t k);

/// One selecting row's selection in one layer: [KVH, m] block positions (on the engine's device and on CPU) and the
/// union of the heads' blocks in position order (the row's admission unit).
struct RowSelection {
  at::Tensor pos, pos_cpu;
  std::vector<int64_t> union_pos, union_blocks;
  /// Pool slot of every (head, selected block), [KVH * m], given the union's slots (in union order).
  std::vector<int64_t> head_slots(const std::vector<int64_t>& union_slots) const;
};

/// How select_rows scores a layer's selecting rows.
enum class Scoring {
  kAten,    ///< row by row with ATen ops (quest_scores, top_blocks): what the reference repeats
  kNative,  ///< row by row with the CPU kernel (select_blocks' native_scores): key metadata on CPU, contiguous
  kBatched  ///< every row at once with batched ATen ops on the query's device; on a CPU query, as kAten
};

/// Select the blocks of every selecting row of a plan for one layer (the rows' queries scored against the layer's
/// key metadata), then record each row's selection in the layer's last_selection and the compressed counters, in row
/// order. kNative with at least two selecting rows per thread scores the rows in one parallel region (a row per
/// task); otherwise row by row, each row's scoring split over the threads: the choices are the same either way.
/// kBatched off the CPU scores and chooses every selecting row at once (batched ATen ops over the rows' candidates,
/// padded to the longest row's; no op waits for the device before the positions' one copy to the host): the same
/// rule as select_blocks, its bounds equal to quest_scores' within float32 rounding (a different matmul shape), so a
/// selection differs only where two bounds tie within that rounding.
/// @param query [>= tokens, num_heads, head_size] the layer's query
/// @return one entry per plan row (empty for rows that do not select)
std::vector<RowSelection> select_rows(const StepPlan& plan, LayerState& layer, const at::Tensor& query,
                                      const Selection& sel, Scoring scoring, Telemetry& telemetry);

}  // namespace activekv
