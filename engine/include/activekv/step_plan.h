#pragma once
/// @file step_plan.h
/// @brief The step plan: what one vLLM step asks of every layer, validated and planned once by Engine::build and
///        read by each layer's forward, which then only admits, moves and computes.
///
/// Owns: the checks of vLLM's step metadata (query_start_loc, seq_lens, block_table), the rows that have query tokens
/// with their context's block ids (the largest id kept, so a forward checks them against its KV cache's size in one
/// comparison), the admission units of every row (exact rows: tiles of tile_blocks blocks; a compressed decode row
/// beyond the budget: one unit, the union its layer's selection chooses), and the admission rounds of a forward path
/// that computes several units per call (the CPU kernel's), with the split of each round into (row, KV heads) tasks,
/// and the decode batch one CUDA launch attends (DecodeBatch). Everything here is the same for every layer of the step.
#include <activekv/geometry.h>
#include <activekv/telemetry.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace activekv {

/// A request row of the step that has query tokens.
struct PlannedRow {
  int64_t req = 0;          ///< its index in the step's metadata (the request row)
  int64_t q0 = 0;           ///< first query token
  int64_t lq = 0;           ///< query tokens (>= 1)
  int64_t seq = 0;          ///< context length (computed + new tokens)
  int64_t nb = 0;           ///< context blocks: geometry.blocks_for(seq)
  int64_t first_block = 0;  ///< its context's block ids are StepPlan::blocks[first_block, first_block + nb)
  int64_t first_unit = 0;   ///< its admission units are [first_unit, first_unit + num_units) of the step
  int64_t num_units = 0;    ///< exact rows: ceil(nb / tile_blocks) tiles; a selecting row: 1
  /// Compressed mode, a decode row whose context exceeds the budget: its unit is the union of the KV heads'
  /// selections, chosen per layer (selection.h).
  bool selects = false;
  at::Tensor row_blocks;      ///< selecting rows: the context's block ids, int64 [nb] on CPU
  at::Tensor row_blocks_dev;  ///< the same on the engine's device for a device pool (undefined on CPU)
};

/// An admission round of a path that computes several units per call: its units end at `end` (they start where the
/// previous round's end), and its (row, KV heads) tasks take `heads_per_task` KV heads each.
struct UnitRound {
  int64_t end = 0;
  int64_t heads_per_task = 1;
};

/// The decode rows of a step that one kernel launch attends together (the CUDA path's decode batch, cuda_kernel.h):
/// exact decode rows (one query token, no selection) when the path's batch kernel takes the geometry. Made once per
/// step by build, its device arrays included; a layer's forward takes it when every block it reads is on the device
/// (placement in place, or all of them resident in the pool), else its rows go through admission with the others.
struct DecodeBatch {
  std::vector<int64_t> rows;     ///< indices into StepPlan::rows, ascending
  std::vector<char> member;      ///< [StepPlan::rows] 1 for a row of the batch (empty when the batch is)
  std::vector<int64_t> blocks;   ///< the rows' context block ids, row after row
  int64_t units = 0;             ///< the rows' admission units (exact tiles): what telemetry counts as tiles computed
  int64_t items = 0;             ///< split-K work items: runs of at most `split` 16-token sub-tiles of one row
  int64_t split = 0;             ///< 16-token sub-tiles per work item
  at::Tensor arrays;             ///< int32 on the engine's device, laid out as cuda_kernel.h CudaBatchArgs says
  bool empty() const { return rows.empty(); }
};

/// One vLLM step's plan, shared by every layer of the step.
struct StepPlan {
  at::Tensor query_start_loc;  ///< [num_reqs + 1] int32, cumulative query tokens per request row
  at::Tensor seq_lens;         ///< [num_reqs] int32, context length per row (computed + new tokens)
  at::Tensor block_table;      ///< [num_reqs, max_blocks] int32, vLLM physical block ids per row
  int64_t num_reqs = 0;
  int64_t num_actual_tokens = 0;  ///< query tokens that are real (rows past it are padding)
  int64_t build_id = 0;           ///< build counter value that made this plan

  std::vector<PlannedRow> rows;    ///< rows with query tokens, in request order
  std::vector<int64_t> blocks;     ///< their context block ids, row after row (each >= 0)
  int64_t max_block = -1;          ///< the largest of `blocks`, -1 if none
  std::vector<int64_t> unit_row;   ///< [units] index in `rows` of each admission unit's row
  int64_t exact_tiles = 0;         ///< exact-mode tiles planned (units of rows that do not select)
  bool selecting = false;          ///< some row selects per layer (its unit's size is known only then)
  /// Rounds for a path that computes several units per call, when no row selects: made for `rounds_pool` pool slots
  /// and `rounds_threads` intra-op threads (a forward with others makes its own).
  std::vector<UnitRound> rounds;
  int64_t rounds_pool = 0;
  int64_t rounds_threads = 0;
  DecodeBatch batch;  ///< made by build where the engine's path attends a decode batch (forward_path.h plan_batch)
  /// Compressed mode with dense layers (EngineConfig::dense_layers), a step where some row selects: the plan the
  /// dense layers take, the same rows with none selecting; null otherwise (every layer takes this plan).
  std::shared_ptr<const StepPlan> dense;

  int64_t num_units() const { return static_cast<int64_t>(unit_row.size()); }
};

/// The block ids of one admission unit.
struct UnitBlocks {
  const int64_t* ids = nullptr;
  int64_t n = 0;
};

/// Check vLLM's step metadata and plan the step (everything but the rounds, see plan_rounds).
/// @param query_start_loc, seq_lens, block_table index tensors (int32 / int64) checked by the caller for dtype and
///        rank, with at least num_reqs + 1, num_reqs and num_reqs rows
/// @param per_head_blocks compressed mode: blocks a selecting row attends per KV head; 0 in exact mode (no row selects)
/// @param device the engine's device (selecting rows' block ids are copied there for a device pool)
/// @param telemetry counts the block ids checked and the exact tiles planned (kPlannedBlocks, kPlannedTiles): once
///        per step, which tests/test_engine_plan.py holds against the layers' forwards
/// @throws c10::ValueError / c10::IndexError naming the entry, before anything is planned or counted.
StepPlan plan_step(const Geometry& g, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                   const at::Tensor& block_table, int64_t num_reqs, int64_t num_actual_tokens,
                   int64_t per_head_blocks, at::Device device, Telemetry& telemetry);

/// Block ids of unit u of an exact row of the plan (not of a selecting row).
UnitBlocks exact_unit(const StepPlan& plan, const Geometry& g, int64_t u);

/// Check the plan's block ids against a KV cache of host_blocks blocks: one comparison with the plan's largest id.
/// @throws c10::IndexError naming the first entry of the block table (in row-major order) outside [0, host_blocks).
void check_plan_blocks(const StepPlan& plan, int64_t host_blocks);

/// Admission rounds for a path that computes several units per call: units are taken in order while each fits the
/// pool beside those taken already (pool_blocks minus the distinct blocks they hold, the pool's pinned slots when they
/// are admitted), as admitting them one at a time would; a round's tasks are whole rows (heads_per_task =
/// num_kv_heads) with at least two of its rows per thread, else the most KV heads (a divisor of num_kv_heads) that give
/// every thread the same number of tasks, else one.
std::vector<UnitRound> plan_rounds(const StepPlan& plan, const std::vector<UnitBlocks>& units, int64_t pool_blocks,
                                   int64_t num_kv_heads, int64_t threads);

}  // namespace activekv
