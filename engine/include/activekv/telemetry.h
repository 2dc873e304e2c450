#pragma once
/// @file telemetry.h
/// @brief Counters and histograms of one engine, and the process-wide registry of live engines.
///
/// Counters are exact event counts (deterministic, compared bit for bit with the Python reference); histograms
/// hold per-forward latency (microseconds, wall clock, never compared) and blocks admitted per forward.
///
/// Publication across processes: vLLM runs the engine in its engine-core (or worker) process while its API server,
/// which serves Prometheus' /metrics, is another process. Every registered engine therefore keeps its counters and
/// histograms in a TelemetryPage, a fixed-layout segment of lock-free atomics mapped from a file
/// `activekv-telemetry.<pid>.<engine id>.<16 random hex digits>` in telemetry_dir(), unlinked when the engine is
/// destroyed. A reader in an ancestor process (the API server) maps the segments of its descendant processes
/// read-only: snapshot_process_tree().
///
/// Hostile input: the base folder (default /dev/shm, a tmpfs: no disk I/O) is writable by every local user, so the
/// segments live in a per-user folder under it, `<base>/activekv-telemetry-<uid>`, created with mode 0700 and used
/// only when it is a directory (not a link) owned by this user with mode 0700; segments are new files
/// (O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600) of unpredictable names; a reader maps only regular files of this user
/// with mode 0600 and a page's exact size (opened O_NONBLOCK | O_NOFOLLOW: a FIFO or a link is skipped, never waited
/// on or followed), and never writes to a path read from a page. When the folder is refused or the segment cannot be
/// created, the engine keeps the same page in heap memory (only its own process sees it) and says why once on stderr.
#include <array>
#include <atomic>
#include <chrono>
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
  kBytesD2H,             ///< bytes of new K/V written device -> host tier by KV updates (tiered only; else 0)
  kTilesComputed,        ///< attention tiles computed (one per request row per tile)
  kHostRebinds,          ///< times a layer's host tier changed storage and its pool/page table was reset
  kCompressedRows,       ///< decode rows that attended a selection (compressed mode, context beyond the budget)
  kCompressedContextBlocks,  ///< blocks those rows' contexts held (what exact mode would have attended per head)
  kSelectedBlocks,       ///< blocks attended, summed over those rows and their KV heads
  kUnionBlocks,          ///< blocks admitted for those rows: the union over each row's KV heads
  kPlannedBlocks,        ///< block ids build checked and planned: the context blocks of every row with query tokens
  kPlannedTiles,         ///< exact-mode tiles build planned (rows that do not select); once per step, not per layer
  kBlocksInPlace,        ///< blocks attended where they are in the host tier (in-place placement: no admission)
  kDecodeBatchRows,      ///< decode rows attended by one launch for the step's batch (CUDA; every block on the device)
  kCount
};

/// Snapshot key of a counter.
const char* counter_name(Counter c);

/// Every gauge: the engine's state now (not a count of events), published in the same page as the counters, so the
/// API server's HTTP routes (bindings/modules/endpoint.cpp) read them from another process.
enum class Gauge : int {
  kMode = 0,            ///< 0 exact, 1 compressed (set once at construction)
  kPoolResidentBlocks,  ///< active-pool slots holding a block, summed over layers, after the last forward
  kPoolCapacityBlocks,  ///< active-pool slots, summed over layers (pool_blocks x num_layers)
  kLastStepUnixUs,      ///< wall clock (system_clock, microseconds since the Unix epoch) at the end of the last forward
  kLastForwardUs,       ///< duration of the last forward (one layer, one step), microseconds
  kKeyMetadataBytes,    ///< bytes of per-block key min/max held, summed over layers (compressed mode; 0 in exact)
  kCount
};

/// Snapshot key of a gauge.
const char* gauge_name(Gauge g);

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

struct TelemetryPage;

/// A point-in-time copy of an engine's telemetry.
struct TelemetrySnapshot {
  std::vector<std::pair<std::string, int64_t>> counters;
  std::vector<std::pair<std::string, Histogram>> histograms;
  std::vector<std::pair<std::string, int64_t>> info;  ///< static facts of the engine (num_layers, pool_blocks, ...)
  std::vector<std::pair<std::string, int64_t>> gauges;  ///< Gauge order; merged: mode kept where all agree (else
                                                         ///< -1), pool gauges summed, last step/forward of the latest
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

  void add(Counter c, int64_t n = 1);
  int64_t get(Counter c) const;
  void observe_forward_latency_us(double us);
  void observe_blocks_admitted(int64_t blocks);
  void set_gauge(Gauge g, int64_t value);
  /// Record a static fact of the engine, reported in every snapshot's info (e.g. num_layers).
  void set_info(const std::string& key, int64_t value);
  TelemetrySnapshot snapshot() const;
  /// Zero every counter and histogram.
  void reset();
  /// Process-unique id of this engine's telemetry (registration order).
  int64_t id() const { return id_; }
  /// Path of this engine's shared segment; empty when the page lives in heap memory (unregistered, or the segment
  /// could not be created).
  const std::string& segment_path() const { return segment_path_; }
  /// Write the telemetry of the engines of this process that share `path` (see write_telemetry_json) when this
  /// engine is destroyed and when the process exits normally; when the process ends otherwise (os._exit), an
  /// ancestor process's snapshot_process_tree() writes it from the segment, if that process was configured with the
  /// same path (expect_descendant_telemetry_json). Empty: never.
  void set_json_path(const std::string& path);
  const std::string& json_path() const { return json_path_; }

 private:
  TelemetryPage* page_ = nullptr;  ///< mapped segment or heap copy (owned)
  bool mapped_ = false;
  std::string segment_path_;
  std::string segment_folder_;  ///< telemetry_dir() at creation (the environment may change later)
  std::string segment_name_;    ///< file name there: unlinked through a freshly checked folder descriptor
  mutable std::mutex mu_;  ///< guards info_ and json_path_
  std::map<std::string, int64_t> info_;
  std::string json_path_;
  int64_t id_ = -1;
  bool registered_;
};

/// Snapshots of every live engine in the process, in registration order.
std::vector<std::pair<int64_t, TelemetrySnapshot>> snapshot_live_engines();

/// Counters and info summed over snapshots, histograms merged bucket by bucket; info keeps num_layers summed and
/// every other fact only where all snapshots agree. Empty counters when `all` is empty.
TelemetrySnapshot merge_snapshots(const std::vector<TelemetrySnapshot>& all);

/// Base folder of the segments: $ACTIVEKV_TELEMETRY_DIR if set, else /dev/shm (writable by every local user).
std::string telemetry_base_dir();

/// Folder of this user's segments: telemetry_base_dir() + "/activekv-telemetry-<effective uid>" (see the file comment
/// for what it must be before it is used).
std::string telemetry_dir();
/// Why telemetry_dir() can hold no segment to read: "" when it is a folder this user's engines publish in, else what
/// is wrong with it (missing: no engine of this user has published, or could not create it; not private; ...).
std::string telemetry_dir_problem();

/// One engine's telemetry as published by some process.
struct PublishedTelemetry {
  int64_t pid = 0;
  int64_t engine_id = 0;
  TelemetrySnapshot snapshot;
};

/// The telemetry of every live engine of this process (from memory) and of every process descended from it (from
/// their segments in telemetry_dir()), ordered by (pid, engine id). Segments whose process is gone (or whose pid
/// was reused: the start time differs) are removed; when such an engine set telemetry_json, this process is one of
/// its ancestors and expect_descendant_telemetry_json() named the same path here, its final values (the segment
/// outlives the process) are written to that file first, merged per path. Segments of unrelated live processes are
/// ignored. Never throws and never blocks on a bad entry: a file that is not a regular 0600 file of this user of a
/// page's size, or not a page, is skipped and left alone; a refused folder is skipped with one warning on stderr.
/// `at_exit` (collect_ended_descendants_at_exit): a descendant whose telemetry_json would be written here and whose
/// process still runs is waited for, up to kExitWait for all of them, and its file written from its page either way.
std::vector<PublishedTelemetry> snapshot_process_tree(bool at_exit = false);

/// How long the exit-time snapshot_process_tree() waits for descendants that are still ending (vLLM's own grace for a
/// best-effort shutdown is 5 s).
inline constexpr std::chrono::milliseconds kExitWait{5000};

/// Let snapshot_process_tree() write `path` for descendant engines that ended (os._exit) and asked for the same
/// telemetry_json: the API server calls this with the option from its own configuration (vLLM hands the engine core
/// the same one). The path in a page only selects among these; it is never written to on its own.
void expect_descendant_telemetry_json(const std::string& path);

/// At this process's normal exit, run snapshot_process_tree(at_exit=true) once more, so that descendant engines that
/// ended with their process (never destroyed) and asked for telemetry_json get their file written, those still
/// ending after vLLM's SIGKILL included (the API server calls this: vLLM's engine-core process ends with os._exit,
/// which runs no destructor and no atexit handler, or is killed).
void collect_ended_descendants_at_exit();

/// One Prometheus sample of a family: its sample name (the family's, or with _total, _bucket, _count or _sum), the
/// value of its `le` label (a histogram bucket's upper bound as prometheus_client writes it: "1.0", ..., "+Inf"; empty
/// on samples without one) and its value.
struct MetricSample {
  std::string name;
  std::string le;
  double value = 0;
};

/// One Prometheus metric family (the fields of prometheus_client's Metric): name, help text, unit, type ("counter",
/// "histogram" or "gauge") and samples. The binding adds the caller's labels and exposes it.
struct MetricFamily {
  std::string name, help, unit, type;
  std::vector<MetricSample> samples;
};

/// Every activekv_* family from the telemetry of a process tree (snapshot_process_tree()): a counter per Counter
/// (activekv_<name>_total, summed), the forward latency histogram in seconds and the blocks admitted per forward
/// histogram, and gauges: activekv_engines (how many engines published), activekv_layers (layers they serve), and the
/// engines' Gauge values (activekv_mode, activekv_pool_resident_blocks, activekv_pool_capacity_blocks,
/// activekv_last_step_timestamp_seconds, activekv_last_forward_seconds, activekv_key_metadata_bytes).
std::vector<MetricFamily> prometheus_families(const std::vector<PublishedTelemetry>& published);

/// (counter snapshot key, its Prometheus sample name activekv_..._total), in Counter order.
std::vector<std::pair<std::string, std::string>> prometheus_counter_names();

/// The snapshot as one JSON object: {"counters": {...}, "histograms": {name: {"le": [...], "counts": [...],
/// "count": n, "sum": s}}, "info": {...}} (the last `le` is the string "+Inf"), and "gauges": {...} after "info"
/// when `with_gauges` (the HTTP route's payload; the telemetry_json file keeps the three keys).
std::string snapshot_to_json(const TelemetrySnapshot& s, bool with_gauges = false);

/// `v` as Python's repr(float) writes it: the shortest digits that read back as `v` exactly, fixed notation for
/// decimal exponents -4..15 (with ".0" when integral: "1.0", "-0.0"), "1e+16"/"1.5e-05" beyond, "inf", "-inf", "nan".
/// The Prometheus `le` labels (as prometheus_client writes them) and the HTTP routes' JSON numbers use it.
std::string float_repr(double v);

/// `s` as a JSON string literal, quotes included: `"` and `\` escaped, control characters as \u00XX; other bytes
/// (UTF-8) as they are.
std::string json_string(const std::string& s);

/// Write merge_snapshots(...) of every engine of this process whose json path is `path` (live ones and those
/// already destroyed) to `path` (through a temporary file and a rename). @throws c10::Error when it cannot be written.
void write_telemetry_json(const std::string& path);

}  // namespace activekv
