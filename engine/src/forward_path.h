#pragma once
// Private to engine/src/: the forward path, what computes the admitted units of a step for one layer. One per engine,
// chosen at construction by make_forward_path: the ATen tile path (forward_aten.cpp, the bit-exact path the Python
// reference mirrors), the CPU kernel's path (cpu/forward_cpu.cpp) and the CUDA kernel's path (forward_cuda.cpp, which
// falls back to the ATen path for the rows its kernel does not take). Engine::forward owns what they share: the
// admission loop (units admitted round by round, pins released after each round; in place, the units' block ids
// handed over as they are), selection and telemetry of admission; a path owns its per-layer query layout, online-softmax state, compute and output.
#include <activekv/engine.h>
#include <activekv/selection.h>
#include <activekv/step_plan.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace activekv {

/// One layer's forward of a planned step, as the paths see it.
struct LayerStep {
  const StepPlan& plan;
  LayerState& layer;
  /// What the units' slots index, [blocks, num_kv_heads, 2, block_size, head_size] contiguous: the layer's pool, or
  /// in place its host tier (the slots are then the blocks' own ids)
  const at::Tensor& kv;
  const at::Tensor& query;  ///< [>= tokens, num_heads, head_size], the geometry's dtype
  const at::Tensor& out;    ///< [>= tokens, num_heads, head_size] contiguous, written for the plan's rows
  double scale;
  const std::vector<RowSelection>& selections;  ///< by plan row: the layer's selection of each selecting row
  /// The plan's decode batch (StepPlan::batch) is attended by one launch in this layer (attend_batch): its rows are
  /// neither admitted nor given per-row state
  bool batch = false;
  at::Tensor page;  ///< with `batch` on a pool: the layer's page table on the device (KVState::device_page)
  /// A tiered engine's copy stream, where the paths queue their per-unit index copies (transfer.h index_tensor);
  /// nullptr otherwise
  const c10::Stream* upload = nullptr;
};

/// An admitted unit: its index in the step and the slots of its blocks in LayerStep::kv (in the unit's order).
struct AdmittedUnit {
  int64_t unit = 0;
  std::vector<int64_t> slots;
};

/// Computes the admitted units of a step, layer by layer. Engine::forward calls begin, then attend_batch where the
/// layer takes the decode batch, then attend once per round of admitted units (pinned while it runs), then finish;
/// calls are serialised by the engine's lock.
class ForwardPath {
 public:
  virtual ~ForwardPath() = default;
  /// Whether one attend call takes several units: units are then admitted while they fit the pool together
  /// (StepPlan rounds); otherwise one unit is admitted, computed and released at a time.
  virtual bool batches_units() const = 0;
  /// How compressed selection scores a layer's selecting rows (selection.h Scoring): row by row with ATen ops as the
  /// reference does, unless the path has its own way.
  virtual Scoring scoring() const { return Scoring::kAten; }
  /// Plan the step's decode batch (StepPlan::batch) at build, where the path attends one (the CUDA path).
  virtual void plan_batch(StepPlan& plan) const {}
  /// Whether this layer's tensors let the plan's decode batch run (the kernel reads them in 16-byte pieces).
  virtual bool batch_fits(const LayerStep& s) const { return false; }
  /// Attend the plan's decode batch in one launch and write its rows' output (s.batch is set).
  virtual void attend_batch(const LayerStep& s) {}
  /// Prepare the layer's per-row state (grouped queries, online-softmax state) for the plan's rows.
  virtual void begin(const LayerStep& s) = 0;
  /// Compute the admitted units of one round; heads_per_task: the round's task split (batching paths).
  virtual void attend(const LayerStep& s, const std::vector<AdmittedUnit>& round, int64_t heads_per_task) = 0;
  /// Write every planned row's output.
  virtual void finish(const LayerStep& s) = 0;
};

/// The ATen tile path; the CUDA path derives from it (its rows outside the CUDA kernel's shapes run here).
class AtenPath : public ForwardPath {
 public:
  AtenPath(const Geometry& g, const Selection& sel, at::Device device, Telemetry& telemetry)
      : g_(g), sel_(sel), device_(device), telemetry_(telemetry) {}
  bool batches_units() const override { return false; }
  void begin(const LayerStep& s) override;
  void attend(const LayerStep& s, const std::vector<AdmittedUnit>& round, int64_t heads_per_task) override;
  void finish(const LayerStep& s) override;

 protected:
  /// A row's state: its query grouped per KV head [KVH, G * lq, D] float32 and its online softmax.
  struct RowState {
    at::Tensor qg;
    OnlineSoftmax st;
  };
  /// Exact tile `tile` of plan row i, its blocks at `slots`.
  virtual void attend_tile(const LayerStep& s, size_t i, int64_t tile, const std::vector<int64_t>& slots);
  /// Plan row i's selection, its union at `union_slots`.
  virtual void attend_selected(const LayerStep& s, size_t i, const std::vector<int64_t>& union_slots);
  /// Whether row i's grouped query must be contiguous (read by pointer).
  virtual bool contiguous_query(int64_t rows) const { return false; }
  /// Whether plan row i is attended by this layer's decode batch launch.
  static bool in_batch(const LayerStep& s, size_t i) { return s.batch && s.plan.batch.member[i] != 0; }

  const Geometry& g_;
  const Selection& sel_;
  at::Device device_;
  Telemetry& telemetry_;
  std::vector<RowState> rows_;
};

/// The engine's path: kNative on CPU the CPU kernel's, kNative on CUDA with the CUDA kernel built the CUDA path, else
/// the ATen path.
std::unique_ptr<ForwardPath> make_forward_path(Kernel kernel, const Geometry& g, const Selection& sel,
                                               at::Device device, Telemetry& telemetry);
/// The CPU kernel's path (cpu/forward_cpu.cpp) and the CUDA path (forward_cuda.cpp).
std::unique_ptr<ForwardPath> make_cpu_path(const Geometry& g, const Selection& sel, Telemetry& telemetry);
std::unique_ptr<ForwardPath> make_cuda_path(const Geometry& g, const Selection& sel, at::Device device,
                                            Telemetry& telemetry);

}  // namespace activekv
