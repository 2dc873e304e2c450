#pragma once
// The vLLM patch series, read and checked natively: which patches of a series are applied to a vLLM tree, and whether
// the ACTIVEKV backend can run there. Pure C++ (no Python headers, no pybind11): the static library series/, linked
// into the `activekv` launcher (bindings/launcher/, which also applies and reverts the series) and into the `_backend`
// module (bindings/modules/backend_series.cpp: the start-up check of series/startup.h a Python user's vLLM process
// runs). patch_series.cpp reads and checks; verdict.cpp draws the verdicts (the launcher's marker, the problem texts).
//
// Every check drives git as a subprocess (posix_spawn, `git apply --check [--reverse]`): it reads files and never
// changes anything. Errors are thrown as PatchError, whose message says what was expected and what was found.
#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace activekv::series {

struct PatchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Small file helpers (shared with the launcher).
bool is_file(const std::string& path);
bool is_dir(const std::string& path);
std::string dirname(const std::string& path);
std::string join(const std::string& a, const std::string& b);
/// realpath(3), or `path` unchanged when it cannot be resolved.
std::string real_path(const std::string& path);

/// The most bytes read from one file: the series file, a patch, vllm/_version.py, a file the series touches,
/// pyvenv.cfg. Fifty times vLLM 0.32.0's largest Python file (322 kB) and three thousand times the series' largest
/// patch (5 kB): only a file that is not what its name says reaches it.
inline constexpr std::size_t kMaxFileBytes = std::size_t{16} << 20;

/// The bytes of the regular file at `path` (symbolic links followed), or nullopt when there is no file there (ENOENT,
/// ENOTDIR). Nothing else is read: the path is stat()ed, then opened non-blocking (a FIFO's open returns at once
/// instead of waiting for a writer) and fstat()ed, and anything but a regular file of at most kMaxFileBytes (a FIFO,
/// a device such as /dev/zero, a directory, a larger file) throws PatchError "cannot read PATH: expected a regular
/// file of at most 16 MiB (16777216 bytes), got a FIFO"; so does a failed open or read (with strerror).
std::optional<std::string> read_file_if_exists(const std::string& path);

/// read_file_if_exists, with no file there a PatchError too ("cannot read PATH: No such file or directory").
std::string read_regular_file(const std::string& path);

/// read_file_if_exists for optional files (pyvenv.cfg): false, `out` unchanged, for any file it would not read.
bool read_file(const std::string& path, std::string& out);

/// The vLLM version the series and the engine are built for (ACTIVEKV_VLLM_PATCH_VERSION, e.g. "0.32.0").
const std::string& series_vllm_version();

/// One patch against a tree: its reverse applies (applied), it applies (not applied), or neither (conflict: the files
/// match neither side, e.g. vLLM was changed, or patched by another series).
enum class State { Applied, NotApplied, Conflict };
const char* state_name(State s);

/// A series directory: a `series` file listing 000N-*.patch files (git format-patch output), in order.
struct Series {
  std::string directory;
  std::vector<std::string> names;  // 000N-*.patch, in order

  std::string path(size_t i) const { return join(directory, names[i]); }

  /// Reads directory/series: one patch file name a line, trimmed of spaces, tabs and CRs; blank lines and '#'
  /// comments skipped. Each name must be a file name in `directory` ending in .patch (no '/', not "." or "..", no
  /// control character, NUL included; not ".patch" alone), listed once, naming a regular file of at most
  /// kMaxFileBytes. Throws PatchError before anything else reads the series: no series file (or one read_file_if_exists
  /// refuses), an entry that is no such name (its line and the entry, control characters as \xNN), a listed patch
  /// missing or not a regular file, an empty list.
  static Series load(const std::string& directory);

  /// Paths relative to the tree root that the series creates or changes, in first-seen order: both names of each
  /// `diff --git a/OLD b/NEW` line (whole line, names without whitespace; git quotes names with whitespace, which are
  /// not read). Throws PatchError when a patch cannot be read (read_regular_file).
  std::vector<std::string> touched_files() const;

  /// The commit subject `git am` gives patch i (the Subject header, continuation lines joined with one space, without
  /// its "[PATCH n/m] " prefix). Throws
  /// PatchError when the patch cannot be read.
  std::string subject(size_t i) const;
};

struct GitResult {
  int code = -1;
  std::string output;  // stdout and stderr together
  bool ok() const { return code == 0; }
};

/// A vLLM tree: a directory holding vllm/ (an installed package's site-packages, or the root of a git checkout).
class Tree {
 public:
  Tree(std::string root, bool checkout) : root_(std::move(root)), checkout_(checkout) {}

  const std::string& root() const { return root_; }
  bool checkout() const { return checkout_; }

  /// Runs `git -C root args...`; output captured. An installed tree gets no user or system git configuration and no
  /// repository above it; a checkout keeps the user's configuration (git am commits as them). Throws PatchError when
  /// git cannot be run or waited for.
  GitResult git(const std::vector<std::string>& args) const;

  GitResult git_apply(const std::vector<std::string>& patches, bool reverse, bool check) const;

 private:
  std::string root_;
  bool checkout_;
};

/// The tree whose root is `root` (which holds vllm/); a checkout when `root` is the top of its own git repository (a
/// site-packages inside a checkout is not).
Tree tree_at(const std::string& root);

/// The root of the tree at a directory given by the user (one holding vllm/__init__.py, or the vllm package directory
/// itself), resolved with realpath(3); runs no git. Throws PatchError for any other directory.
std::string tree_root(const std::string& path);

/// The tree of a directory given by the user: tree_at(tree_root(path)). Throws PatchError as tree_root does.
Tree resolve_tree(const std::string& path);

/// The version written in root/vllm/_version.py (read, not imported): the first line `__version__ = 'X'` or
/// `__version__ = version = 'X'` (from the line's start; either quote; whitespace around '=' optional; anything after
/// the closing quote; a final CR dropped), as tools/vllm_patch.py's _VERSION_RE reads it. Throws PatchError when there
/// is none, or the file cannot be read (read_file_if_exists).
std::string vllm_version(const Tree& tree);

/// Each patch's state on the tree (git apply --check, reverse then forward).
std::vector<State> patch_states(const Tree& tree, const Series& series);

/// "applied" (every patch), "not applied" (none) or "partially applied".
std::string series_state(const std::vector<State>& states);

/// What the ACTIVEKV backend's start-up check found on a tree.
struct Check {
  std::string root;          // the tree's root (holds vllm/)
  bool checkout = false;     // the root of a git checkout of vLLM (else an installed package)
  std::string series_dir;    // the series compared with it
  std::vector<std::string> names;  // the series' patches
  std::string version;       // vLLM's version in the tree
  bool version_ok = false;   // version == series_vllm_version()
  std::vector<State> states; // per patch; empty when the version differs (not compared)
  std::string state;         // series_state(states); "" when the version differs

  bool ok() const { return version_ok && state == "applied"; }
};

/// Reads the tree's vLLM version and, when it is the series', each patch's state. Throws PatchError (no version file,
/// git missing).
Check check_series(const Tree& tree, const Series& series);

/// Why `activekv serve` / `run-batch` refuse the ACTIVEKV backend ("" when check.ok()): the launcher's message.
std::string preflight_problem(const Check& check);

// ---- one check per tree: the launcher's verdict, handed to the processes it starts ----

/// The variable `activekv serve` / `run-batch` export after their check passed (docs/reliability.md, "The patch series
/// check"): which tree carries which series, and the state of every file the verdict depends on. The `_backend` module
/// (and each vLLM worker, which inherits the environment) then skips git when the marker matches the vLLM it imported
/// and the series installed next to it, file state included; anything else is checked as before.
inline constexpr const char* kVerifiedVar = "ACTIVEKV_PATCH_VERIFIED";

/// Every input of check_series(tree_at(root), series) but the tree's location, as one value: this build's vLLM
/// version, the series (its `series` file and each patch, bytes) and, in the tree, vllm/_version.py and each file the
/// series touches (regular file: executable bit and bytes; symbolic link: its target; absent; or another kind), so
/// equal digests mean equal inputs to `git apply --check`. Hash: FNV-1a 64-bit (Fowler, Noll, Vo;
/// http://www.isthe.com/chongo/tech/comp/fnv/) over length-prefixed fields: it tells accidental change (a reinstall,
/// an edit, a revert) from none; it is no protection against a forged value, which needs no more access than
/// ACTIVEKV_SKIP_PATCH_CHECK=1. Reads files, runs no git. Returns "fnv1a64:" + 16 lowercase hex digits. Throws
/// PatchError when a file cannot be read.
std::string state_digest(const std::string& root, const Series& series);

/// What a passed check verified: the fields of an ACTIVEKV_PATCH_VERIFIED value.
struct Verified {
  std::string vllm_version;  // series_vllm_version() of the build that checked (e.g. "0.32.0")
  std::string state;         // state_digest(tree, series)
  std::string tree;          // the tree's root, a real path (holds vllm/)
  std::string series_dir;    // the series' directory, a real path
};

/// "v1;vllm=VERSION;state=fnv1a64:HEX16;tree=DIR;series=DIR"; "" when a field cannot be written in that form (a path
/// that is not absolute or holds ';' or a control character): then no marker is exported and every process checks.
std::string format_verified(const Verified& v);

/// What a passed check of `series` on the tree whose root is `root` vouches for, from the files as they are now (no
/// check runs, no git): {series_vllm_version(), state_digest(root, series), root, series.directory}. `root` is taken as
/// given: pass tree_root()'s real path. Throws PatchError as state_digest does.
Verified verified_now(const std::string& root, const Series& series);

/// The ACTIVEKV_PATCH_VERIFIED value for `root` and `series` now: format_verified(verified_now(root, series)), the value
/// the launcher exports after its check passed ("" where a path cannot be written in it). Throws PatchError as
/// state_digest does.
std::string verified_marker(const std::string& root, const Series& series);

/// Parses a value of format_verified's form. Throws PatchError naming the variable, the expected form and the value.
Verified parse_verified(const std::string& value);

/// "" when `marker` vouches for `here` (every field equal), else which field differs, for messages: "another vLLM tree
/// (DIR)", "another patch series (DIR)", "the ActiveKV release for vLLM X", or that the files changed since.
std::string verified_mismatch(const Verified& marker, const Verified& here);

/// Why the ACTIVEKV backend cannot run in a Python process's vLLM ("" when check.ok()): what was expected, what was
/// found (per patch when the series is not fully applied) and the commands that fix it, naming the tree.
std::string startup_problem(const Check& check);

}  // namespace activekv::series
