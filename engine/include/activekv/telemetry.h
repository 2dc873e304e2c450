#pragma once
/// @file telemetry.h
/// @brief Counters and histograms of one engine, and the process-wide registry of live engines.
///
/// Counters are exact event counts (deterministic, compared bit for bit with the Python reference); histograms
/// hold per-forward latency (microseconds, wall clock, never compared) and blocks admitted per forward.
#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace activekv {

/// Every counter, in snapshot order. Names are the snapshot keys.
enum class Counter : int {
  kBuildCalls = 0,       ///< native build entries (one per vLLM step with attention metadata)
  kKvUpdateCalls,        ///< native KV-update entries (one per layer per step)
  kForwardCalls,         ///< native forward entries with a step plan (one per layer per step)
  kForwardSkipped,       ///< forward entries without metadata (vLLM warm-up/profiling): output untouched
  kRequestRows,          ///< request rows planned by build, summed over steps
  kTokensWritten,        ///< tokens written into the host tier (padding slots excluded)
  kPaddingSlots,         ///< slot-mapping entries of -1 (vLLM's PAD_SLOT_ID) skipped
  kWriteThroughTokens,   ///< tokens also written into a resident pool copy (coherence)
  kBlocksAdmitted,       ///< blocks copied host -> pool
  kBlocksEvicted,        ///< resident blocks evicted (least recently used, unpinned) to make room
  kBlocksHit,            ///< blocks found resident when a tile asked for them
  kBytesH2D,             ///< bytes copied host tier -> pool
  kBytesD2H,             ///< bytes of new K/V copied device -> host tier by KV updates (tiered only; else 0)
  kTilesComputed,        ///< attention tiles computed (one per request row per tile)
  kHostRebinds,          ///< times a layer's host tier changed storage and its pool/page table was reset
  kCompressedRows,       ///< decode rows that attended a selection (compressed mode, context beyond the budget)
  kCompressedContextBlocks,  ///< blocks those rows' contexts held (what exact mode would have attended per head)
  kSelectedBlocks,       ///< blocks attended, summed over those rows and their KV heads
  kUnionBlocks,          ///< blocks admitted for those rows: the union over each row's KV heads
  kCount
};

/// Snapshot key of a counter.
const char* counter_name(Counter c);

/// A histogram with fixed power-of-two bucket upper bounds 1, 2, 4, ... 2^(kBuckets-2) and +inf.
struct Histogram {
  static constexpr int kBuckets = 24;
  std::array<int64_t, kBuckets> counts{};
  int64_t count = 0;
  double sum = 0.0;
  void observe(double value);
  /// Upper bound of bucket i (the last is +infinity).
  static double upper_bound(int i);
};

/// A point-in-time copy of an engine's telemetry.
struct TelemetrySnapshot {
  std::vector<std::pair<std::string, int64_t>> counters;
  std::vector<std::pair<std::string, Histogram>> histograms;
  std::vector<std::pair<std::string, int64_t>> info;  ///< static facts of the engine (num_layers, pool_blocks, ...)
};

/// Telemetry of one engine. Thread-safe: counters are atomic, histograms guarded by a mutex.
/// Registers itself in the process-wide registry on construction and leaves it on destruction.
class Telemetry {
 public:
  /// @param registered list this telemetry among the process's live engines (false for standalone part objects).
  explicit Telemetry(bool registered = true);
  ~Telemetry();
  Telemetry(const Telemetry&) = delete;
  Telemetry& operator=(const Telemetry&) = delete;

  void add(Counter c, int64_t n = 1) { counters_[static_cast<int>(c)].fetch_add(n, std::memory_order_relaxed); }
  int64_t get(Counter c) const { return counters_[static_cast<int>(c)].load(std::memory_order_relaxed); }
  void observe_forward_latency_us(double us);
  void observe_blocks_admitted(int64_t blocks);
  /// Record a static fact of the engine, reported in every snapshot's info (e.g. num_layers).
  void set_info(const std::string& key, int64_t value);
  TelemetrySnapshot snapshot() const;
  /// Zero every counter and histogram.
  void reset();
  /// Process-unique id of this engine's telemetry (registration order).
  int64_t id() const { return id_; }

 private:
  std::array<std::atomic<int64_t>, static_cast<int>(Counter::kCount)> counters_{};
  mutable std::mutex mu_;
  Histogram forward_latency_us_;
  Histogram blocks_admitted_per_forward_;
  std::map<std::string, int64_t> info_;
  int64_t id_ = -1;
  bool registered_;
};

/// Snapshots of every live engine in the process, in registration order.
std::vector<std::pair<int64_t, TelemetrySnapshot>> snapshot_live_engines();

}  // namespace activekv
