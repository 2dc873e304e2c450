#pragma once
// The `_backend` module's start-up check, once per process: does the vLLM this Python process imported carry the patch
// series installed next to the module? Pure C++ over plain values the binding reads from the interpreter
// (sys.modules['vllm'].__file__ and the environment); the verdict of the first call is kept for the process.
#include "patch_series.h"

#include <optional>
#include <string>

namespace activekv::series {

/// The escape hatch: "1" starts without the check. For environments that cannot run it, chiefly where git is not
/// installed (docs/vllm_support.md applies the series with patch(1) there); the user then vouches for the series.
inline constexpr const char* kSkipCheckVar = "ACTIVEKV_SKIP_PATCH_CHECK";

/// The series in `patch_dir` (the one installed next to the module, or a caller's), read from its real path. Throws
/// PatchError when there is no such directory (the message says the wheel's series is missing) or Series::load refuses
/// it.
Series load_installed_series(const std::string& patch_dir);

/// The check of the tree at `vllm_dir` (a directory holding vllm/, or the vllm package directory) against the series
/// in `patch_dir`: `problem` is "" when the tree carries the series, else the one message for RuntimeError (what was
/// expected, what was found, the fix), `where` naming the tree in its head. Runs git; never throws.
struct SeriesVerdict {
  Check check;
  std::string problem;
  bool ran = false;  ///< false: the check itself could not run (no vllm there, no series, git missing)
};
SeriesVerdict series_verdict(const std::string& vllm_dir, const std::string& patch_dir, const std::string& where);

/// What the start-up check reads from the process.
struct StartupInputs {
  std::optional<std::string> vllm_file;  ///< sys.modules['vllm'].__file__ when it is a str
  std::string vllm_file_repr;            ///< repr() of that attribute (or of None), for the message
  std::optional<std::string> skip;       ///< $ACTIVEKV_SKIP_PATCH_CHECK
  std::optional<std::string> verified;   ///< $ACTIVEKV_PATCH_VERIFIED (kVerifiedVar)
  std::string patch_dir;                 ///< the series installed next to the module ("" when unknown)
};

/// The verdict already decided in this process, if any (so the binding reads nothing more from the interpreter).
std::optional<std::string> decided_startup_problem();

/// Why the ACTIVEKV backend cannot run here ("" when it can): the vLLM of `in` does not carry the series in
/// in.patch_dir (another vLLM version, a series not or only partly applied, files changed, another release's series),
/// or that cannot be checked. Decided on the first call, later calls return the first verdict: the vLLM modules
/// already imported do not change when the files on disk do, so a fix takes effect only in a new process anyway.
/// ACTIVEKV_SKIP_PATCH_CHECK=1 skips the check (another value than 1 or 0 is itself the problem).
/// ACTIVEKV_PATCH_VERIFIED (exported by `activekv serve` after its own check passed) skips git when it names this
/// tree, this series and their files' state as they are now; a value of another form is itself the problem. Runs git
/// (call it without the GIL); never throws.
std::string decide_startup_problem(const StartupInputs& in);

}  // namespace activekv::series
