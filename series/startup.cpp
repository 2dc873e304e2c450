// The `_backend` module's start-up check of the patch series, decided once per process (startup.h).
#include "startup.h"

#include <mutex>

namespace activekv::series {

namespace {

std::mutex g_mu;
bool g_decided = false;
std::string g_problem;

Check check_tree(const std::string& vllm_dir, const std::string& patch_dir) {
  return check_series(resolve_tree(vllm_dir), load_installed_series(patch_dir));
}

/// What the launcher's marker means for the tree at `vllm_dir` and the series in `patch_dir`: "" when it vouches for
/// exactly them (same build's vLLM version, tree, series and file state), else why not (for the message should this
/// process's own check fail). Reads files, runs no git. A tree or series that cannot be read is "not vouched for": the
/// check that follows says what is wrong with it.
std::string marker_mismatch(const Verified& marker, const std::string& vllm_dir, const std::string& patch_dir) {
  try {
    return verified_mismatch(marker, verified_now(tree_root(vllm_dir), load_installed_series(patch_dir)));
  } catch (const PatchError& e) {
    return std::string("a tree and series that cannot be compared here (") + e.what() + ")";
  }
}

std::string decide(const StartupInputs& in) {
  const std::string hatch = std::string(". Set ") + kSkipCheckVar + "=1 to start without this check (where it "
                            "cannot run, e.g. without git) only if the vLLM there carries this ActiveKV's series";
  const std::string skip = in.skip.value_or("");
  if (skip == "1") return "";
  if (!skip.empty() && skip != "0") {
    return std::string(kSkipCheckVar) + " must be 1 (start without the patch series check) or 0, got '" + skip + "'";
  }
  if (!in.vllm_file || in.vllm_file->empty()) {
    return "cannot check that ActiveKV's patch series is applied to the vLLM this process imported: "
           "sys.modules['vllm'] has no __file__ (got " + in.vllm_file_repr + ")" + hatch;
  }
  // The launcher's marker, parsed before anything is compared: a value of another form is refused, as a malformed
  // ACTIVEKV_SKIP_PATCH_CHECK is, never taken for "no marker".
  std::optional<Verified> marker;
  if (in.verified && !in.verified->empty()) {
    try {
      marker = parse_verified(*in.verified);
    } catch (const PatchError& e) {
      return e.what();
    }
  }
  const std::string vllm_dir = dirname(*in.vllm_file);
  const std::string why_not = marker ? marker_mismatch(*marker, vllm_dir, in.patch_dir) : std::string();
  if (marker && why_not.empty()) return "";  // `activekv serve` checked this very tree, series and file state
  const SeriesVerdict v = series_verdict(vllm_dir, in.patch_dir, "the vLLM this process imported");
  if (v.problem.empty()) return "";
  const std::string note =
      marker ? std::string(" (") + kVerifiedVar + " did not spare this check: it names " + why_not + ")" : "";
  return (v.ran ? v.problem : v.problem + hatch) + note;
}

}  // namespace

Series load_installed_series(const std::string& patch_dir) {
  if (patch_dir.empty() || !is_dir(patch_dir)) {
    throw PatchError("this ActiveKV's patch series is not installed next to its _backend module (expected " +
                     (patch_dir.empty() ? std::string("<activekv>/patches") : patch_dir) +
                     "); reinstall the ActiveKV wheel");
  }
  return Series::load(real_path(patch_dir));
}

SeriesVerdict series_verdict(const std::string& vllm_dir, const std::string& patch_dir, const std::string& where) {
  SeriesVerdict v;
  try {
    v.check = check_tree(vllm_dir, patch_dir);
    v.ran = true;
    const std::string why = startup_problem(v.check);
    if (!why.empty()) v.problem = "the ACTIVEKV attention backend cannot run on " + where + ": " + why;
  } catch (const PatchError& e) {
    v.problem = "cannot check that ActiveKV's patch series is applied to " + where + " (" + vllm_dir + "): " + e.what();
  }
  return v;
}

std::optional<std::string> decided_startup_problem() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_decided) return std::nullopt;
  return g_problem;
}

std::string decide_startup_problem(const StartupInputs& in) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_decided) {
    g_problem = decide(in);
    g_decided = true;
  }
  return g_problem;
}

}  // namespace activekv::series
