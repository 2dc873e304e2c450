#include <activekv/telemetry.h>

#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <new>
#include <set>
#include <sstream>

namespace activekv {

constexpr int kCounters = static_cast<int>(Counter::kCount);
constexpr int kGauges = static_cast<int>(Gauge::kCount);
constexpr int kHistograms = 2;  // forward_latency_us, blocks_admitted_per_forward
constexpr int kInfoSlots = 16;
constexpr int kInfoKey = 40;
constexpr int kAncestors = 8;
constexpr int kJsonPath = 1024;
const char* const kHistogramNames[kHistograms] = {"forward_latency_us", "blocks_admitted_per_forward"};
constexpr const char* kSegmentPrefix = "activekv-telemetry.";
constexpr const char* kFolderPrefix = "/activekv-telemetry-";  // + the effective uid, under telemetry_base_dir()

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

namespace {

constexpr uint64_t kLayout = static_cast<uint64_t>(kCounters) | (static_cast<uint64_t>(kHistograms) << 16) |
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
Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: engines may outlive static destruction order
  return *r;
}

/// (ppid, start time) of a live process from /proc/<pid>/stat; false when it does not exist or is a zombie (it has
/// exited and waits to be reaped).
bool proc_stat(int64_t pid, int64_t* ppid, int64_t* start_ticks) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!f || !std::getline(f, line)) return false;
  const auto close = line.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return false;
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {  // fields after ')' start at 3 (state)
    if (i == 3 && (field == "Z" || field == "X")) return false;
    if (i == 4) *ppid = std::atoll(field.c_str());
    if (i == 22) {
      *start_ticks = std::atoll(field.c_str());
      return true;
    }
  }
  return false;
}

bool descends_from(int64_t pid, int64_t ancestor) {
  for (int depth = 0; depth < 64 && pid > 1; ++depth) {
    if (pid == ancestor) return true;
    int64_t ppid = 0, start = 0;
    if (!proc_stat(pid, &ppid, &start)) return false;
    pid = ppid;
  }
  return pid == ancestor;
}

/// Print `message` on stderr the first time this process meets it (a scrape every few seconds must not flood).
void warn_once(const std::string& message) {
  auto& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (!r.warned.insert(message).second) return;
  }
  std::fprintf(stderr, "activekv: %s\n", message.c_str());
}

std::string file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  return "not a directory";
}

/// What an operator can do about a folder open_private_folder() refuses.
constexpr const char* kFolderFix =
    "; remove it, or set ACTIVEKV_TELEMETRY_DIR to a folder only this user can write (the engines and the API server "
    "must see the same one)";

/// Open `path` (telemetry_dir(): the user's private folder) as a directory descriptor (O_CLOEXEC), after checking
/// that it is a directory (not a symbolic link) owned by this user with mode 0700: the base folder is writable by
/// every local user, so anyone may have created that name first. `create`: make it (mode 0700) when it does not
/// exist. Returns -1 with `why` empty when it does not exist (and `create` is false), or with `why` saying what was
/// expected and what was found. Every later access goes through the descriptor (openat, unlinkat), so the folder
/// checked is the folder used even if the name is replaced meanwhile.
int open_private_folder(const std::string& path, bool create, std::string* why) {
  const uid_t uid = ::geteuid();
  const std::string expected =
      path + " must be a directory owned by uid " + std::to_string(uid) + " with mode 0700 (not a symbolic link)";
  bool created = false;
  if (create) {
    if (::mkdir(path.c_str(), 0700) == 0) {
      created = true;
    } else if (errno != EEXIST) {
      *why = "cannot create " + path + ": " + std::strerror(errno);
      return -1;
    }
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    struct stat st {};
    if (err == ENOENT && !create) return -1;  // no engine of this user has published here yet
    if ((err == ELOOP || err == ENOTDIR) && ::lstat(path.c_str(), &st) == 0) {
      *why = expected + ", found " + file_kind(st.st_mode) + kFolderFix;
    } else {
      *why = "cannot open " + path + ": " + std::strerror(err);
    }
    return -1;
  }
  struct stat st {};
  if (created) ::fchmod(fd, 0700);  // mkdir's mode is reduced by the umask
  if (::fstat(fd, &st) != 0) {
    *why = "cannot stat " + path + ": " + std::strerror(errno);
  } else if (st.st_uid != uid) {
    *why = expected + ", found owner uid " + std::to_string(st.st_uid) + kFolderFix;
  } else if ((st.st_mode & 07777) != 0700) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    *why = expected + ", found mode " + mode + kFolderFix;
  } else {
    return fd;
  }
  ::close(fd);
  return -1;
}

/// 16 hex digits from the kernel's random source: segment names nobody can predict. A collision is still checked
/// (O_EXCL); without getrandom the clock and a counter only keep the names apart.
std::string random_suffix() {
  uint64_t bits = 0;
  if (::getrandom(&bits, sizeof bits, GRND_NONBLOCK) != static_cast<ssize_t>(sizeof bits)) {
    static std::atomic<uint64_t> counter{0};
    bits = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ULL ^
           counter.fetch_add(1, std::memory_order_relaxed);
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(bits));
  return hex;
}

/// This process's umask, read without changing it (umask(2) would set it, racing other threads): /proc/self/status
/// has it since Linux 4.7; 022 otherwise.
mode_t process_umask() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("Umask:", 0) == 0) return static_cast<mode_t>(std::strtoul(line.c_str() + 6, nullptr, 8));
  }
  return 022;
}

void init_page(TelemetryPage* p, int64_t engine_id) {
  p->layout = kLayout;
  p->pid = static_cast<int64_t>(::getpid());
  int64_t ppid = 0, start = 0;
  p->start_ticks = proc_stat(p->pid, &ppid, &start) ? start : -1;
  p->engine_id = engine_id;
  int64_t up = p->pid;
  for (int i = 0; i < kAncestors && up > 1; ++i) {
    int64_t parent = 0, ignored = 0;
    if (!proc_stat(up, &parent, &ignored)) break;
    p->ancestors[i] = parent;
    up = parent;
  }
  p->magic.store(TelemetryPage::kMagic, std::memory_order_release);
}

double load_double(const std::atomic<uint64_t>& bits) {
  const uint64_t b = bits.load(std::memory_order_relaxed);
  double d;
  std::memcpy(&d, &b, sizeof d);
  return d;
}

void add_double(std::atomic<uint64_t>& bits, double v) {
  uint64_t old = bits.load(std::memory_order_relaxed);
  for (;;) {
    double d;
    std::memcpy(&d, &old, sizeof d);
    d += v;
    uint64_t next;
    std::memcpy(&next, &d, sizeof next);
    if (bits.compare_exchange_weak(old, next, std::memory_order_relaxed)) return;
  }
}

void observe(TelemetryPage::Hist& h, double value) {
  int i = 0;
  while (i < Histogram::kBuckets - 1 && value > Histogram::upper_bound(i)) ++i;
  h.counts[i].fetch_add(1, std::memory_order_relaxed);
  add_double(h.sum_bits, value);
}

/// Read a page into a snapshot (count = the sum of the buckets, so _count always equals the +Inf bucket).
TelemetrySnapshot read_page(const TelemetryPage& p) {
  TelemetrySnapshot s;
  for (int i = 0; i < kCounters; ++i)
    s.counters.emplace_back(counter_name(static_cast<Counter>(i)), p.counters[i].load(std::memory_order_relaxed));
  for (int k = 0; k < kHistograms; ++k) {
    Histogram h;
    for (int b = 0; b < Histogram::kBuckets; ++b) {
      h.counts[b] = p.hist[k].counts[b].load(std::memory_order_relaxed);
      h.count += h.counts[b];
    }
    h.sum = load_double(p.hist[k].sum_bits);
    s.histograms.emplace_back(kHistogramNames[k], h);
  }
  for (int i = 0; i < kGauges; ++i)
    s.gauges.emplace_back(gauge_name(static_cast<Gauge>(i)), p.gauges[i].load(std::memory_order_relaxed));
  const int n = std::min(p.info_count.load(std::memory_order_acquire), kInfoSlots);
  for (int i = 0; i < n; ++i) {
    const char* key = p.info[i].key;
    s.info.emplace_back(std::string(key, strnlen(key, kInfoKey)), p.info[i].value.load(std::memory_order_relaxed));
  }
  return s;
}


std::string json_double(double v) {
  if (std::isinf(v)) return "\"+Inf\"";
  if (std::isnan(v)) return "\"NaN\"";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

void write_json_file(const std::string& path, const std::vector<TelemetrySnapshot>& all) {
  const std::string text = snapshot_to_json(merge_snapshots(all));
  // A new file of an unpredictable name (mkostemp: O_CREAT | O_EXCL), never one found there: the folder may be
  // shared (/tmp), and a link planted at a name we would open with truncation makes us overwrite its target.
  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = ::mkostemp(tmp.data(), O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot create a temporary file ", tmp, " for ActiveKV telemetry: ", std::strerror(errno));
  ::fchmod(fd, 0666 & ~process_umask());  // as an ordinary new file (mkostemp makes it 0600)
  const std::string data = text + "\n";
  size_t done = 0;
  int err = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : EIO;
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && std::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "cannot write ActiveKV telemetry to ", path, " (through ", tmp, "): ", std::strerror(err));
  }
}

void write_json_locked(Registry& r, const std::string& path) {
  std::vector<TelemetrySnapshot> all = r.ended[path];
  for (const auto& [id, t] : r.live)
    if (t->json_path() == path) all.push_back(t->snapshot());
  write_json_file(path, all);
}

void write_all_json_at_exit() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::set<std::string> paths;
  for (const auto& [path, v] : r.ended) paths.insert(path);
  for (const auto& [id, t] : r.live)
    if (!t->json_path().empty()) paths.insert(t->json_path());
  for (const auto& path : paths) {
    try {
      write_json_locked(r, path);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "activekv: %s\n", e.what());
    }
  }
}

}  // namespace

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

const char* counter_name(Counter c) {
  switch (c) {
    case Counter::kBuildCalls: return "build_calls";
    case Counter::kKvUpdateCalls: return "kv_update_calls";
    case Counter::kForwardCalls: return "forward_calls";
    case Counter::kForwardSkipped: return "forward_skipped";
    case Counter::kRequestRows: return "request_rows";
    case Counter::kTokensWritten: return "tokens_written";
    case Counter::kPaddingSlots: return "padding_slots";
    case Counter::kWriteThroughTokens: return "write_through_tokens";
    case Counter::kBlocksAdmitted: return "blocks_admitted";
    case Counter::kBlocksEvicted: return "blocks_evicted";
    case Counter::kBlocksHit: return "blocks_hit";
    case Counter::kBytesH2D: return "bytes_h2d";
    case Counter::kBytesD2H: return "bytes_d2h";
    case Counter::kTilesComputed: return "tiles_computed";
    case Counter::kHostRebinds: return "host_rebinds";
    case Counter::kCompressedRows: return "compressed_rows";
    case Counter::kCompressedContextBlocks: return "compressed_context_blocks";
    case Counter::kSelectedBlocks: return "selected_blocks";
    case Counter::kUnionBlocks: return "union_blocks";
    case Counter::kPlannedBlocks: return "planned_blocks";
    case Counter::kPlannedTiles: return "planned_tiles";
    case Counter::kCount: break;
  }
  return "unknown";
}

const char* gauge_name(Gauge g) {
  switch (g) {
    case Gauge::kMode: return "mode";
    case Gauge::kPoolResidentBlocks: return "pool_resident_blocks";
    case Gauge::kPoolCapacityBlocks: return "pool_capacity_blocks";
    case Gauge::kLastStepUnixUs: return "last_step_unix_us";
    case Gauge::kLastForwardUs: return "last_forward_us";
    case Gauge::kCount: break;
  }
  return "unknown";
}

double Histogram::upper_bound(int i) {
  return i >= kBuckets - 1 ? std::numeric_limits<double>::infinity() : std::ldexp(1.0, i);
}

void Histogram::observe(double value) {
  int i = 0;
  while (i < kBuckets - 1 && value > upper_bound(i)) ++i;
  ++counts[i];
  ++count;
  sum += value;
}

std::string telemetry_base_dir() {
  const char* env = std::getenv("ACTIVEKV_TELEMETRY_DIR");
  return env != nullptr && *env != '\0' ? std::string(env) : std::string("/dev/shm");
}

std::string telemetry_dir() { return telemetry_base_dir() + kFolderPrefix + std::to_string(::geteuid()); }

Telemetry::Telemetry(bool registered) : registered_(registered) {
  int64_t id = -1;
  if (registered_) {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    id = r.next_id++;
  }
  if (registered_) {
    std::string why;
    const std::string folder = telemetry_dir();
    const int dir = open_private_folder(folder, /*create=*/true, &why);
    int fd = -1;
    std::string name;
    // A new file, never one found there (O_EXCL; O_NOFOLLOW for good measure), of a name nobody can predict; a
    // collision, however unlikely, draws another name.
    for (int attempt = 0; dir >= 0 && fd < 0 && attempt < 8; ++attempt) {
      name = kSegmentPrefix + std::to_string(::getpid()) + "." + std::to_string(id) + "." + random_suffix();
      fd = ::openat(dir, name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (fd < 0 && errno != EEXIST) {
        why = "cannot create " + folder + "/" + name + ": " + std::strerror(errno);
        break;
      }
    }
    if (fd >= 0) {
      void* mem = MAP_FAILED;
      // fchmod: the umask may have taken bits off 0600, and a reader accepts exactly 0600.
      if (::fchmod(fd, 0600) == 0 && ::ftruncate(fd, sizeof(TelemetryPage)) == 0)
        mem = ::mmap(nullptr, sizeof(TelemetryPage), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      const int err = errno;
      ::close(fd);
      if (mem != MAP_FAILED) {
        page_ = new (mem) TelemetryPage();  // the file is zero-filled: every atomic starts at 0
        mapped_ = true;
        segment_folder_ = folder;
        segment_name_ = name;
        segment_path_ = folder + "/" + name;
      } else {
        ::unlinkat(dir, name.c_str(), 0);
        why = "cannot map " + folder + "/" + name + ": " + std::strerror(err);
      }
    } else if (dir >= 0 && why.empty()) {
      why = "no new segment name in " + folder + " after 8 attempts";
    }
    if (dir >= 0) ::close(dir);
    if (!mapped_) {
      warn_once("telemetry publishing disabled: " + why +
                ". This process's engines count as before (snapshot(), telemetry_json), but /metrics and "
                "/v1/activekv/* of the API server do not see them");
    }
  }
  if (page_ == nullptr) page_ = new TelemetryPage();
  init_page(page_, id);
  if (registered_) {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    id_ = id;
    r.live[id_] = this;
  }
}

Telemetry::~Telemetry() {
  if (registered_) {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.live.erase(id_);
    if (!json_path_.empty()) {
      r.ended[json_path_].push_back(snapshot());
      try {
        write_json_locked(r, json_path_);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "activekv: %s\n", e.what());  // a destructor must not throw
      }
    }
  }
  if (mapped_) {
    std::string why;
    const int dir = open_private_folder(segment_folder_, /*create=*/false, &why);
    if (dir >= 0) {  // otherwise the folder was replaced meanwhile: remove nothing from whatever is there now
      ::unlinkat(dir, segment_name_.c_str(), 0);
      ::close(dir);
    }
    ::munmap(page_, sizeof(TelemetryPage));
  } else {
    delete page_;
  }
}

void Telemetry::add(Counter c, int64_t n) {
  page_->counters[static_cast<int>(c)].fetch_add(n, std::memory_order_relaxed);
}

int64_t Telemetry::get(Counter c) const {
  return page_->counters[static_cast<int>(c)].load(std::memory_order_relaxed);
}

void Telemetry::observe_forward_latency_us(double us) { observe(page_->hist[0], us); }

void Telemetry::observe_blocks_admitted(int64_t blocks) { observe(page_->hist[1], static_cast<double>(blocks)); }

void Telemetry::set_gauge(Gauge g, int64_t value) {
  page_->gauges[static_cast<int>(g)].store(value, std::memory_order_relaxed);
}

void Telemetry::add_gauge(Gauge g, int64_t delta) {
  page_->gauges[static_cast<int>(g)].fetch_add(delta, std::memory_order_relaxed);
}

void Telemetry::set_info(const std::string& key, int64_t value) {
  std::lock_guard<std::mutex> lock(mu_);
  info_[key] = value;
  const int n = page_->info_count.load(std::memory_order_relaxed);
  for (int i = 0; i < n; ++i) {
    if (key == page_->info[i].key) {
      page_->info[i].value.store(value, std::memory_order_relaxed);
      return;
    }
  }
  if (n >= kInfoSlots || key.size() >= static_cast<size_t>(kInfoKey)) return;  // kept in memory only
  std::memcpy(page_->info[n].key, key.c_str(), key.size() + 1);
  page_->info[n].value.store(value, std::memory_order_relaxed);
  page_->info_count.store(n + 1, std::memory_order_release);
}

void Telemetry::set_json_path(const std::string& path) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  json_path_ = path;
  if (path.size() < static_cast<size_t>(kJsonPath)) {  // a longer path is written by this process only
    std::memcpy(page_->json_path, path.c_str(), path.size() + 1);
    page_->json_path_len.store(static_cast<int32_t>(path.size()), std::memory_order_release);
  }
  if (!path.empty() && !r.atexit_registered) {
    std::atexit(write_all_json_at_exit);
    r.atexit_registered = true;
  }
}

TelemetrySnapshot Telemetry::snapshot() const {
  TelemetrySnapshot s = read_page(*page_);
  std::lock_guard<std::mutex> lock(mu_);
  s.info.assign(info_.begin(), info_.end());
  return s;
}

void Telemetry::reset() {
  for (auto& c : page_->counters) c.store(0, std::memory_order_relaxed);
  for (auto& h : page_->hist) {
    for (auto& b : h.counts) b.store(0, std::memory_order_relaxed);
    h.sum_bits.store(0, std::memory_order_relaxed);
  }
}

std::vector<std::pair<int64_t, TelemetrySnapshot>> snapshot_live_engines() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::pair<int64_t, TelemetrySnapshot>> out;
  for (const auto& [id, t] : r.live) out.emplace_back(id, t->snapshot());
  return out;
}

TelemetrySnapshot merge_snapshots(const std::vector<TelemetrySnapshot>& all) {
  TelemetrySnapshot total;
  for (const auto& s : all) {
    if (total.counters.empty()) {
      total = s;
      continue;
    }
    for (size_t i = 0; i < s.counters.size() && i < total.counters.size(); ++i)
      total.counters[i].second += s.counters[i].second;
    for (size_t i = 0; i < s.histograms.size() && i < total.histograms.size(); ++i) {
      auto& h = total.histograms[i].second;
      const auto& o = s.histograms[i].second;
      for (int b = 0; b < Histogram::kBuckets; ++b) h.counts[b] += o.counts[b];
      h.count += o.count;
      h.sum += o.sum;
    }
    // info: num_layers adds up (layers served); any other fact is kept only where every engine agrees.
    std::vector<std::pair<std::string, int64_t>> merged;
    for (const auto& [tk, tv] : total.info) {
      for (const auto& [k, v] : s.info) {
        if (k != tk) continue;
        if (k == "num_layers") merged.emplace_back(k, tv + v);
        else if (v == tv) merged.emplace_back(k, tv);
      }
    }
    total.info = std::move(merged);
    // gauges: mode kept where every engine agrees (else -1), pool gauges summed, the last forward of the latest step.
    if (s.gauges.size() == total.gauges.size() && s.gauges.size() == static_cast<size_t>(kGauges)) {
      auto& g = total.gauges;
      const auto at = [](Gauge k) { return static_cast<size_t>(k); };
      if (g[at(Gauge::kMode)].second != s.gauges[at(Gauge::kMode)].second) g[at(Gauge::kMode)].second = -1;
      g[at(Gauge::kPoolResidentBlocks)].second += s.gauges[at(Gauge::kPoolResidentBlocks)].second;
      g[at(Gauge::kPoolCapacityBlocks)].second += s.gauges[at(Gauge::kPoolCapacityBlocks)].second;
      if (s.gauges[at(Gauge::kLastStepUnixUs)].second > g[at(Gauge::kLastStepUnixUs)].second) {
        g[at(Gauge::kLastStepUnixUs)].second = s.gauges[at(Gauge::kLastStepUnixUs)].second;
        g[at(Gauge::kLastForwardUs)].second = s.gauges[at(Gauge::kLastForwardUs)].second;
      }
    }
  }
  return total;
}

std::vector<PublishedTelemetry> snapshot_process_tree() {
  const int64_t self = static_cast<int64_t>(::getpid());
  std::vector<PublishedTelemetry> out;
  for (auto& [id, s] : snapshot_live_engines()) out.push_back({self, id, std::move(s)});
  std::set<std::string> configured;  // the telemetry_json paths this process's own configuration named
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    configured = r.descendant_json;
  }
  std::string why;
  const int dir = open_private_folder(telemetry_dir(), /*create=*/false, &why);
  if (dir < 0) {
    if (!why.empty()) warn_once("telemetry of other processes not read: " + why);
    return out;
  }
  std::vector<std::string> names;
  const int list_fd = ::fcntl(dir, F_DUPFD_CLOEXEC, 0);
  if (DIR* d = list_fd >= 0 ? ::fdopendir(list_fd) : nullptr) {
    while (const dirent* e = ::readdir(d)) {
      if (std::strncmp(e->d_name, kSegmentPrefix, std::strlen(kSegmentPrefix)) == 0) names.emplace_back(e->d_name);
    }
    ::closedir(d);  // closes list_fd
  } else if (list_fd >= 0) {
    ::close(list_fd);
  }
  std::map<std::string, std::vector<TelemetrySnapshot>> orphans;  // json path -> final snapshots of ended engines
  for (const auto& name : names) {
    // O_NONBLOCK: opening a FIFO for reading would wait for a writer; O_NOFOLLOW: a link is not a segment. Only a
    // regular file of this user, mode 0600, of a page's exact size is mapped: what an engine of this user creates.
    const int fd = ::openat(dir, name.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st {};
    void* mem = MAP_FAILED;
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid() && (st.st_mode & 07777) == 0600 &&
        st.st_size == static_cast<off_t>(sizeof(TelemetryPage)))
      mem = ::mmap(nullptr, sizeof(TelemetryPage), PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (mem == MAP_FAILED) continue;
    const auto* page = static_cast<const TelemetryPage*>(mem);
    if (page->magic.load(std::memory_order_acquire) == TelemetryPage::kMagic && page->layout == kLayout &&
        page->pid != self) {
      int64_t ppid = 0, start = 0;
      if (!proc_stat(page->pid, &ppid, &start) || start != page->start_ticks) {
        // Its process is gone (or the pid names another process now) without destroying the engine: vLLM's engine
        // core ends with os._exit. The page holds the final values: when the engine asked for telemetry_json, this
        // process is its ancestor and this process's own configuration names the same path, write them now. The
        // page's path only selects among the paths configured here: a path read from a file is never written to.
        // A segment whose ancestors are all gone is removed too.
        const int32_t len = page->json_path_len.load(std::memory_order_acquire);
        bool ours = false, orphaned = true;
        for (int i = 0; i < kAncestors && page->ancestors[i] > 0; ++i) {
          ours = ours || page->ancestors[i] == self;
          int64_t p2 = 0, s2 = 0;
          if (page->ancestors[i] > 1 && proc_stat(page->ancestors[i], &p2, &s2)) orphaned = false;
        }
        const auto path = len > 0 && len < kJsonPath && ours ? configured.find(std::string(page->json_path, len))
                                                             : configured.end();
        if (path != configured.end()) {
          orphans[*path].push_back(read_page(*page));
          ::unlinkat(dir, name.c_str(), 0);
        } else if (len <= 0 || orphaned) {
          ::unlinkat(dir, name.c_str(), 0);
        }
      } else if (descends_from(page->pid, self)) {
        out.push_back({page->pid, page->engine_id, read_page(*page)});
      }
    }
    ::munmap(mem, sizeof(TelemetryPage));
  }
  ::close(dir);
  for (const auto& [json_path, snaps] : orphans) {
    try {
      write_json_file(json_path, snaps);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "activekv: %s\n", e.what());
    }
  }
  std::sort(out.begin(), out.end(), [](const PublishedTelemetry& a, const PublishedTelemetry& b) {
    return a.pid != b.pid ? a.pid < b.pid : a.engine_id < b.engine_id;
  });
  return out;
}

std::string snapshot_to_json(const TelemetrySnapshot& s, bool with_gauges) {
  std::ostringstream o;
  o << "{\"counters\": {";
  for (size_t i = 0; i < s.counters.size(); ++i)
    o << (i ? ", " : "") << json_string(s.counters[i].first) << ": " << s.counters[i].second;
  o << "}, \"histograms\": {";
  for (size_t i = 0; i < s.histograms.size(); ++i) {
    const auto& [name, h] = s.histograms[i];
    o << (i ? ", " : "") << json_string(name) << ": {\"le\": [";
    for (int b = 0; b < Histogram::kBuckets; ++b) o << (b ? ", " : "") << json_double(Histogram::upper_bound(b));
    o << "], \"counts\": [";
    for (int b = 0; b < Histogram::kBuckets; ++b) o << (b ? ", " : "") << h.counts[b];
    o << "], \"count\": " << h.count << ", \"sum\": " << json_double(h.sum) << "}";
  }
  o << "}, \"info\": {";
  for (size_t i = 0; i < s.info.size(); ++i)
    o << (i ? ", " : "") << json_string(s.info[i].first) << ": " << s.info[i].second;
  o << "}";
  if (with_gauges) {
    o << ", \"gauges\": {";
    for (size_t i = 0; i < s.gauges.size(); ++i)
      o << (i ? ", " : "") << json_string(s.gauges[i].first) << ": " << s.gauges[i].second;
    o << "}";
  }
  o << "}";
  return o.str();
}

void collect_ended_descendants_at_exit() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.reader_atexit_registered) return;
  r.reader_atexit_registered = true;
  std::atexit([] { snapshot_process_tree(); });
}

void expect_descendant_telemetry_json(const std::string& path) {
  if (path.empty()) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.descendant_json.insert(path);
}

void write_telemetry_json(const std::string& path) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  write_json_locked(r, path);
}

}  // namespace activekv
