// activekv._backend, the patch series half: the start-up check that the vLLM this process imported carries this
// wheel's patch series (series/startup.h, the check `activekv serve` runs before Python starts), the same check on a
// given tree, the launcher's marker, and vLLM's general plugin that warns when the series is missing.
#include <activekv_py/backend_parts.h>
#include <activekv_py/common.h>
#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

#include "patch_series.h"
#include "startup.h"

namespace activekv::py_glue {

namespace {

namespace series = activekv::series;

/// Where the wheel installs the series: <package dir>/patches/vllm/v<version> next to this extension module
/// (CMakeLists.txt installs both under activekv/; the launcher's default_patch_dir is the same folder). The module's
/// file comes from the loader (dladdr on one of its functions), not from Python.
std::string installed_patch_dir() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&installed_patch_dir), &info) == 0 || info.dli_fname == nullptr) return {};
  return series::join(series::dirname(info.dli_fname), "patches/vllm/v" + series::series_vllm_version());
}

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::optional<std::string>(v) : std::nullopt;
}

/// series::decide_startup_problem for the vLLM this process imported (sys.modules['vllm'].__file__); "" when no vLLM
/// is imported (the bindings driven directly, as the tests and tools do: nothing to compare, nothing decided). Reads
/// sys.modules and the environment, imports nothing; git runs without the GIL.
std::string patched_vllm_problem() {
  if (auto decided = series::decided_startup_problem()) return *decided;
  PyObject* modules = PySys_GetObject("modules");  // borrowed
  PyObject* vllm = modules != nullptr && PyDict_Check(modules) ? PyDict_GetItemString(modules, "vllm") : nullptr;
  if (vllm == nullptr) return "";
  series::StartupInputs in;
  const py::object file = py::getattr(py::handle(vllm), "__file__", py::none());
  if (py::isinstance<py::str>(file)) in.vllm_file = file.cast<std::string>();
  in.vllm_file_repr = std::string(py::repr(file));
  in.skip = env(series::kSkipCheckVar);
  in.verified = env(series::kVerifiedVar);
  in.patch_dir = installed_patch_dir();
  py::gil_scoped_release release;
  return series::decide_startup_problem(in);
}

/// Whether the vLLM this process imported lacks vllm/v1/metrics/activekv.py, the module the series' stat-logger patch
/// adds and ActiveKV's vllm.stat_logger_plugins entry point names (pyproject.toml). Reads sys.modules, imports nothing.
bool stat_logger_module_missing() {
  PyObject* modules = PySys_GetObject("modules");  // borrowed
  PyObject* vllm = modules != nullptr && PyDict_Check(modules) ? PyDict_GetItemString(modules, "vllm") : nullptr;
  if (vllm == nullptr) return false;
  const py::object file = py::getattr(py::handle(vllm), "__file__", py::none());
  if (!py::isinstance<py::str>(file)) return false;
  const std::string module = series::join(series::dirname(file.cast<std::string>()), "v1/metrics/activekv.py");
  py::gil_scoped_release release;
  return ::access(module.c_str(), F_OK) != 0;
}

// check_patch_series' and verified_marker's arguments as directory paths: {vllm_dir, patch_dir}, patch_dir None
// meaning the series installed with this module.
std::pair<std::string, std::string> series_args(const py::object& vllm_dir, const py::object& patch_dir) {
  return {activekv::py_glue::path_arg(vllm_dir, "vllm_dir", "directory path"),
          patch_dir.is_none() ? installed_patch_dir()
                              : activekv::py_glue::path_arg(patch_dir, "patch_dir", "directory path")};
}

}  // namespace

void require_patched_vllm() {
  const std::string problem = patched_vllm_problem();
  TORCH_CHECK(problem.empty(), problem);
}

void register_series(py::module_& m) {
  m.def(
      "check_patch_series",
      [](const py::object& vllm_arg, const py::object& patch_arg) {
        const auto [vllm_dir, dir] = series_args(vllm_arg, patch_arg);
        series::SeriesVerdict v;
        {
          py::gil_scoped_release release;
          v = series::series_verdict(vllm_dir, dir, "this vLLM");
        }
        TORCH_CHECK(v.problem.empty(), v.problem);
        py::dict d;
        d["vllm_root"] = v.check.root;
        d["vllm_version"] = v.check.version;
        d["patch_dir"] = v.check.series_dir;
        d["patches"] = v.check.names;
        d["state"] = v.check.state;
        return d;
      },
      py::arg("vllm_dir"), py::arg("patch_dir") = py::none(),
      "The check the backend runs once at start-up (first Impl or Builder) on the vLLM this process imported: the "
      "vLLM tree at vllm_dir (a directory holding vllm/, or the vllm package directory) must be vLLM "
      ACTIVEKV_VLLM_PATCH_VERSION " with every patch of the series in patch_dir applied (default: the series installed "
      "with this module, <activekv>/patches/vllm/v" ACTIVEKV_VLLM_PATCH_VERSION "); both a str or os.PathLike "
      "without NUL characters. Returns {vllm_root, vllm_version, patch_dir, patches, state='applied'}. Raises "
      "RuntimeError naming what was expected, what was found (each patch: applied, not applied, or matching neither "
      "side) and the fix; also when the check cannot run (no vllm "
      "package there, no series, git missing). Runs `git apply --check`; changes nothing.");
  m.def(
      "verified_marker",
      [](const py::object& vllm_arg, const py::object& patch_arg) {
        namespace s = series;
        const auto [vllm_dir, dir] = series_args(vllm_arg, patch_arg);
        std::string marker, error;
        {
          py::gil_scoped_release release;
          try {
            marker = s::verified_marker(s::tree_root(vllm_dir), s::load_installed_series(dir));
          } catch (const s::PatchError& e) {
            error = e.what();
          }
        }
        TORCH_CHECK(error.empty(), "cannot compute the ", s::kVerifiedVar, " value for ", vllm_dir, ": ", error);
        return marker;
      },
      py::arg("vllm_dir"), py::arg("patch_dir") = py::none(),
      "The ACTIVEKV_PATCH_VERIFIED value `activekv serve` / `run-batch` export after their patch series check passed "
      "on the vLLM tree at vllm_dir (a directory holding vllm/, or the vllm package directory) with the series in "
      "patch_dir (default: the series installed with this module), both a str or os.PathLike without NUL "
      "characters, computed from the files as they are now by the launcher's own function (series/patch_series.h, "
      "verified_marker): no check runs, no git. Returns "
      "a str 'v1;vllm=" ACTIVEKV_VLLM_PATCH_VERSION ";state=fnv1a64:<16 hex digits>;tree=<root>;series=<series "
      "dir>' (real paths; state is the FNV-1a 64-bit digest of the series and of the tree's files it touches), or '' "
      "where a path cannot be written in that form (';' or a control character in it: the launcher exports no value "
      "then). Raises RuntimeError when vllm_dir holds no vllm package, patch_dir holds no series (or it lists a "
      "missing patch) or a file cannot be read; TypeError for arguments that are not str.");
  // vLLM's general plugin group ("vllm.general_plugins", entry point in pyproject.toml): vLLM's
  // load_general_plugins() calls it once per vLLM process at start-up (engine core, argument parsing, each worker),
  // whichever attention backend is selected. On a vLLM the
  // series is not applied to, vLLM never imports ActiveKV and selecting ACTIVEKV fails with vLLM's own "Unknown
  // attention backend"; this puts ActiveKV's diagnosis and fix before it, as a warning (never an exception: a vLLM
  // that does not use ActiveKV must still start).
  m.def(
      "vllm_general_plugin",
      []() {
        const std::string problem = patched_vllm_problem();
        if (problem.empty()) return;
        const std::string end = problem.back() == '.' ? " " : ". ";
        std::string msg = "ActiveKV is installed but " + problem + end +
                          "Until then vLLM does not know the ACTIVEKV attention backend (selecting it fails with "
                          "vLLM's 'Unknown attention backend'); other backends are not affected.";
        // vLLM's stat-logger loader (vllm/plugins/__init__.py, load_plugins_by_group) logs the import failure of
        // ActiveKV's entry point with a traceback and no word of ActiveKV: say here, first, what that line means.
        if (stat_logger_module_missing())
          msg += " The API server will also log \"Failed to load plugin activekv\" with \"ModuleNotFoundError: No "
                 "module named 'vllm.v1.metrics.activekv'\": ActiveKV's stat logger (its activekv_* metrics on "
                 "/metrics) is a module the series adds; the same fix clears it, and vLLM serves without those "
                 "metrics until then.";
        if (PyErr_WarnEx(PyExc_RuntimeWarning, msg.c_str(), 1) != 0) throw py::error_already_set();
      },
      "vLLM's general plugin (entry point group vllm.general_plugins), called once per vLLM process at start-up: a "
      "RuntimeWarning naming the problem and the fix when the vLLM this process imported does not carry this "
      "ActiveKV's patch series (the check the first Impl / Builder makes, shared with it), and, where that vLLM lacks "
      "the stat-logger module the series adds, what vLLM's 'Failed to load plugin activekv' line means; nothing "
      "otherwise. Never raises (unless warnings are made errors).");
}

}  // namespace activekv::py_glue
