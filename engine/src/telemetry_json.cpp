// Telemetry as JSON (telemetry.h): the snapshot's JSON text, the telemetry_json file (written through a temporary
// file and a rename, at engine destruction and at exit) and the registry's writers of it.
#include "telemetry_page.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace activekv {

namespace {

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

std::string json_double(double v) {
  if (std::isinf(v)) return "\"+Inf\"";
  if (std::isnan(v)) return "\"NaN\"";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

}  // namespace

namespace telemetry_detail {

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
  // What the rename would replace: only a regular file (start-up refused anything else, check_telemetry_json; this
  // catches what appeared since: a device, FIFO or link would be replaced by the snapshot). Its permission bits go
  // to the snapshot, so a private (0600) file stays private.
  struct stat old {};
  const bool exists = err == 0 && ::lstat(path.c_str(), &old) == 0;
  const bool regular = !exists || S_ISREG(old.st_mode);
  if (exists && regular && ::fchmod(fd, old.st_mode & 07777) != 0 && err == 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && regular && std::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0 || !regular) {
    ::unlink(tmp.c_str());
    TORCH_CHECK(regular, "cannot write ActiveKV telemetry to ", path, ": it is no longer a regular file (a device, "
                "FIFO, socket, directory or symbolic link is never replaced); nothing written");
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
      warn_once_locked(r, error_text(e));  // once, though the engine's destructor may have met it already
    }
  }
}

}  // namespace telemetry_detail

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

void write_telemetry_json(const std::string& path) {
  auto& r = telemetry_detail::registry();
  std::lock_guard<std::mutex> lock(r.mu);
  telemetry_detail::write_json_locked(r, path);
}

}  // namespace activekv
