#pragma once
// The `activekv` executable: finds the Python environment it was installed into, applies the vLLM patch series (in
// C++, through git), and runs vLLM's own command line in an embedded CPython. No Python of ours runs: the payload holds
// none. Built against Python.h for declarations only; libpython is dlopen()ed at run time (see embed.cpp).
#include <string>
#include <vector>

#include "patch_series.h"

namespace activekv::launcher {

/// The Python environment the launcher belongs to, found from the launcher's own location (/proc/self/exe), never
/// through $ORIGIN: a launcher in a venv's bin/ sits next to the venv's `python` symlink, while libpython lives under
/// the base interpreter's prefix, which only the venv's pyvenv.cfg (`home = ...`) names.
struct Environment {
  std::string bin_dir;        // directory holding the launcher: <prefix>/bin
  std::string prefix;         // sys.prefix of the environment (the venv directory, or the installation prefix)
  std::string base_prefix;    // the base interpreter's prefix (pyvenv.cfg's home/..), == prefix outside a venv
  bool venv = false;          // a pyvenv.cfg was found
  std::string python;         // the environment's interpreter: becomes sys.executable (multiprocessing spawns it)
  std::string libpython;      // the shared libpython to dlopen (a path, or a soname for the loader's search)
  std::string libpython_source;  // where libpython came from: "ACTIVEKV_LIBPYTHON", a lib/ directory, or "loader"
  std::string version;        // pyvenv.cfg's `version` (the base interpreter's full version, e.g. 3.11.7), or ""
  std::vector<std::string> site_packages;  // existing site-/dist-packages directories of the environment
  std::string package_dir;    // <site-packages>/activekv, where the payload's data lives ("" when not found)
};

/// Finds the environment; never fails (missing parts stay empty; the commands that need them say so).
Environment find_environment();

/// The patch series shipped in the payload: <package_dir>/patches/vllm/v<version>.
std::string default_patch_dir(const Environment& env);

/// `activekv patch apply|check|revert|status [--vllm DIR] [--patches DIR]`; returns the exit code.
int patch_main(const std::vector<std::string>& args, const Environment& env);

/// The launcher's check of the environment's vLLM before Python starts.
struct Preflight {
  /// Why the ACTIVEKV backend cannot run there ("" when it can): the vLLM version is not the one the series and engine
  /// are built for, or the series is not (or only partly) applied, or the check cannot run.
  std::string problem;
  /// When it can: the ACTIVEKV_PATCH_VERIFIED value naming the tree, the series and their files' state as checked
  /// (series::format_verified), exported to vLLM's processes so their backend skips git. "" when the check failed,
  /// the files changed while git ran (digest before != after), or the value cannot be written (series.h).
  std::string verified;
};

/// Reads files and runs git; never changes anything.
Preflight backend_preflight(const Environment& env);

/// What `activekv serve` does with VLLM_PLUGINS so vLLM loads ActiveKV's endpoint plugin (endpoint plugins load only
/// when named there) while every other plugin loads or not exactly as before.
struct PluginsDecision {
  bool set = false;     // set VLLM_PLUGINS to `value`
  std::string value;
  std::string warning;  // printed to stderr ("" when none)
};

/// `current` is VLLM_PLUGINS (null when unset). Set: `activekv` appended unless listed. Unset: every plugin name of
/// vLLM's lenient groups (general, platform, io_processor, stat_logger) found in the environment's distributions,
/// minus lora_hf_hub_resolver (vLLM enables it only when named), plus `activekv`; left unset with a warning when a
/// lenient plugin's name is also another package's endpoint plugin (naming it would turn its routes on).
PluginsDecision plugins_allowlist(const char* current, const Environment& env);

/// `activekv serve|run-batch ARGS...`: vLLM's CLI in-process; argv entries are raw bytes, decoded as Python would.
int vllm_main(const std::string& subcommand, const std::vector<const char*>& args, const Environment& env);

// Small helpers shared by the launcher's files (series/patch_series.cpp).
using series::dirname;
using series::is_dir;
using series::is_file;
using series::join;
using series::read_file;

}  // namespace activekv::launcher
