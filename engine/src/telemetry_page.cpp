// The shared page of each engine's telemetry (telemetry.h, "Publication across processes"): the per-user segment
// folder, creating, mapping and unlinking an engine's segment, the /proc walk, and reading the pages of this process's
// descendants (snapshot_process_tree), writing the JSON of those that ended with their process.
#include "telemetry_page.h"

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
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <sstream>
#include <thread>

namespace activekv {

namespace {

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

}  // namespace

namespace telemetry_detail {

Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

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

void warn_once(const std::string& message) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  warn_once_locked(r, message);
}

void warn_once_locked(Registry& r, const std::string& message) {
  if (r.warned.insert(message).second) std::fprintf(stderr, "activekv: %s\n", message.c_str());
}

std::string error_text(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  return c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
}

void observe(TelemetryPage::Hist& h, double value) {
  int i = 0;
  while (i < Histogram::kBuckets - 1 && value > Histogram::upper_bound(i)) ++i;
  h.counts[i].fetch_add(1, std::memory_order_relaxed);
  add_double(h.sum_bits, value);
}

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


}  // namespace telemetry_detail

using namespace telemetry_detail;

namespace {

// True while `pid` is the process that started at `start_ticks` and has not ended (a zombie has ended).
bool running(int64_t pid, int64_t start_ticks) {
  int64_t ppid = 0, start = 0;
  return proc_stat(pid, &ppid, &start) && start == start_ticks;
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

}  // namespace

std::string telemetry_base_dir() {
  const char* env = std::getenv("ACTIVEKV_TELEMETRY_DIR");
  return env != nullptr && *env != '\0' ? std::string(env) : std::string("/dev/shm");
}

std::string telemetry_dir() { return telemetry_base_dir() + kFolderPrefix + std::to_string(::geteuid()); }

std::string telemetry_dir_problem() {
  const std::string folder = telemetry_dir();
  std::string why;
  const int fd = open_private_folder(folder, /*create=*/false, &why);
  if (fd >= 0) {
    ::close(fd);
    return "";
  }
  return why.empty() ? folder + " does not exist: no engine of this user has published there (none has started, or "
                                "it could not create the folder: see its warning)"
                     : why;
}

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
                "/activekv/* of the API server do not see them");
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
        warn_once_locked(r, error_text(e));  // a destructor must not throw; the exit writer may meet it again
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

std::vector<PublishedTelemetry> snapshot_process_tree(bool at_exit) {
  const int64_t self = static_cast<int64_t>(::getpid());
  const auto exit_deadline = std::chrono::steady_clock::now() + kExitWait;
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
      const int32_t len = page->json_path_len.load(std::memory_order_acquire);
      bool ours = false;
      for (int i = 0; i < kAncestors && page->ancestors[i] > 0; ++i) ours = ours || page->ancestors[i] == self;
      // The page's path only selects among the paths configured here: a path read from a file is never written to.
      const auto path = len > 0 && len < kJsonPath && ours ? configured.find(std::string(page->json_path, len))
                                                           : configured.end();
      bool alive = running(page->pid, page->start_ticks);
      if (alive && at_exit && path != configured.end()) {
        // This process is exiting and a descendant that asked for a telemetry_json path configured here still runs:
        // vLLM's shutdown (timeout 0 by default) has just sent it SIGKILL, and a killed process takes a moment to
        // end (it unmaps its KV cache), longer on a loaded machine. Wait for it, up to kExitWait for all of them,
        // then write what its page holds: it is never written after this.
        while (alive && std::chrono::steady_clock::now() < exit_deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
          alive = running(page->pid, page->start_ticks);
        }
        orphans[*path].push_back(read_page(*page));
        if (!alive) ::unlinkat(dir, name.c_str(), 0);
      } else if (!alive) {
        // Its process is gone (or the pid names another process now) without destroying the engine: vLLM's engine
        // core ends with os._exit. The page holds the final values: when the engine asked for telemetry_json, this
        // process is its ancestor and this process's own configuration names the same path, write them now. A
        // segment whose ancestors are all gone is removed too.
        const auto orphaned = [&] {  // every recorded ancestor gone
          for (int i = 0; i < kAncestors && page->ancestors[i] > 0; ++i) {
            int64_t p2 = 0, s2 = 0;
            if (page->ancestors[i] > 1 && proc_stat(page->ancestors[i], &p2, &s2)) return false;
          }
          return true;
        };
        if (path != configured.end()) {
          orphans[*path].push_back(read_page(*page));
          ::unlinkat(dir, name.c_str(), 0);
        } else if (len <= 0 || orphaned()) {
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
      warn_once(error_text(e));
    }
  }
  std::sort(out.begin(), out.end(), [](const PublishedTelemetry& a, const PublishedTelemetry& b) {
    return a.pid != b.pid ? a.pid < b.pid : a.engine_id < b.engine_id;
  });
  return out;
}

void collect_ended_descendants_at_exit() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.reader_atexit_registered) return;
  r.reader_atexit_registered = true;
  std::atexit([] { snapshot_process_tree(/*at_exit=*/true); });
}

void expect_descendant_telemetry_json(const std::string& path) {
  if (path.empty()) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.descendant_json.insert(path);
}

}  // namespace activekv
