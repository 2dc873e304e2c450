#pragma once
// Private to the telemetry files: the shared page's layout (TelemetryPage), the process-wide registry of live engines,
// and the helpers the three files share. telemetry.cpp owns the counters, histograms and gauges of one engine and their
// merge; telemetry_page.cpp the shared page (segment files, the /proc walk, the readers of other processes' pages);
// telemetry_json.cpp the JSON text and files and the Prometheus families.
#include <activekv/telemetry.h>

#include <sys/types.h>

#include <set>

namespace activekv {

inline constexpr int kCounters = static_cast<int>(Counter::kCount);
inline constexpr int kGauges = static_cast<int>(Gauge::kCount);
inline constexpr int kHistograms = 2;  // forward_latency_us, blocks_admitted_per_forward
inline constexpr int kInfoSlots = 16;
inline constexpr int kInfoKey = 40;
inline constexpr int kAncestors = 8;
inline constexpr int kJsonPath = 1024;
inline const char* const kHistogramNames[kHistograms] = {"forward_latency_us", "blocks_admitted_per_forward"};
inline constexpr const char* kSegmentPrefix = "activekv-telemetry.";
inline constexpr const char* kFolderPrefix = "/activekv-telemetry-";  // + the effective uid, under telemetry_base_dir()

/// The published layout: plain data and lock-free 8-byte atomics only (address-free, so valid across processes).
/// `magic` is stored last (release) once the header is written; a reader checks it, `layout` and the file size.
struct TelemetryPage {
  static constexpr uint64_t kMagic = 0x414b56544c4d3031ULL;  // "AKVTLM01"
  std::atomic<uint64_t> magic;
  uint64_t layout;  ///< kCounters | kHistograms << 16 | kBuckets << 24 | kInfoSlots << 40
  int64_t pid;
  int64_t start_ticks;  ///< /proc/<pid>/stat field 22: tells a live process from a reused pid
  int64_t engine_id;
  int64_t ancestors[kAncestors];  ///< parent, grandparent, ... at creation (0 past the top): who may write its JSON
  std::atomic<int32_t> json_path_len;  ///< > 0 once json_path holds the telemetry_json option's path
  char json_path[kJsonPath];
  std::atomic<int64_t> counters[kCounters];
  struct Hist {
    std::atomic<int64_t> counts[Histogram::kBuckets];
    std::atomic<uint64_t> sum_bits;  ///< a double, updated by compare-exchange
  } hist[kHistograms];
  std::atomic<int64_t> gauges[kGauges];
  std::atomic<int32_t> info_count;
  struct Info {
    char key[kInfoKey];
    std::atomic<int64_t> value;
  } info[kInfoSlots];
};
static_assert(std::atomic<int64_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "telemetry pages need address-free atomics");

namespace telemetry_detail {

inline constexpr uint64_t kLayout = static_cast<uint64_t>(kCounters) | (static_cast<uint64_t>(kHistograms) << 16) |
                             (static_cast<uint64_t>(Histogram::kBuckets) << 24) |
                             (static_cast<uint64_t>(kInfoSlots) << 40) | (static_cast<uint64_t>(kAncestors) << 48) |
                             (static_cast<uint64_t>(kGauges) << 52) |
                             (uint64_t{3} << 56);  // layout version

struct Registry {
  std::mutex mu;
  int64_t next_id = 0;
  std::map<int64_t, const Telemetry*> live;
  std::map<std::string, std::vector<TelemetrySnapshot>> ended;  ///< json path -> snapshots of destroyed engines
  std::set<std::string> descendant_json;  ///< paths this process may write for ended descendants (its own config)
  std::set<std::string> warned;           ///< warnings already printed (each once per process)
  bool atexit_registered = false;
  bool reader_atexit_registered = false;
};
/// The process-wide registry (never destroyed: engines may outlive static destruction order).
Registry& registry();

/// (ppid, start time) of a live process from /proc/<pid>/stat; false when it does not exist or is a zombie.
bool proc_stat(int64_t pid, int64_t* ppid, int64_t* start_ticks);
/// Print `message` on stderr the first time this process meets it (a scrape every few seconds must not flood).
void warn_once(const std::string& message);
/// warn_once with r.mu already held (the engine's destructor and the exit writer hold it while they write).
void warn_once_locked(Registry& r, const std::string& message);
/// An exception's message for stderr: a c10::Error's without its C++ backtrace.
std::string error_text(const std::exception& e);
/// Add `value` to a page histogram.
void observe(TelemetryPage::Hist& h, double value);
/// Read a page into a snapshot (count = the sum of the buckets, so _count always equals the +Inf bucket).
TelemetrySnapshot read_page(const TelemetryPage& p);
/// Write merge_snapshots(all) as JSON to `path` through a new temporary file and a rename. @throws c10::Error
void write_json_file(const std::string& path, const std::vector<TelemetrySnapshot>& all);
/// write_json_file of the ended and live engines of this process whose json path is `path`; r.mu held.
void write_json_locked(Registry& r, const std::string& path);
/// At exit: write_json_locked for every json path of this process (errors on stderr).
void write_all_json_at_exit();

}  // namespace telemetry_detail

}  // namespace activekv
