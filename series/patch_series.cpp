// The vLLM patch series, read and checked natively (patch_series.h): hand-written readers of untrusted text, file
// helpers, the series file, git as a subprocess and each patch's state on a tree. The verdicts drawn from a check (the
// launcher's marker, the problem texts) are verdict.cpp.
#include "patch_series.h"
#include "text.h"

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

namespace {

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
    // git format-patch folds a long Subject onto continuation lines (leading space or tab); git am joins them with
    // one space, and that is the commit's subject.
    std::string subject(line);
    while (lines.next(line) && !line.empty() && (line[0] == ' ' || line[0] == '\t')) {
      if (const size_t start = line.find_first_not_of(" \t"); start != std::string_view::npos) {
        subject += ' ';
        subject += line.substr(start);
      }
    }
    return subject;
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

}  // namespace activekv::series
