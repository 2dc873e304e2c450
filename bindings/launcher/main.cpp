// `activekv`: version, patch, serve, run-batch. See launcher.h for the shape and embed.cpp for the one entry into
// Python (vLLM's CLI).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "launcher.h"

namespace activekv::launcher {

namespace {

std::string self_path() {
  std::string buf(4096, '\0');
  const ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) return {};
  buf.resize(static_cast<size_t>(n));
  return buf;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return {};
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

/// The value of `key = value` in a pyvenv.cfg ("" when absent): `home` (the base interpreter's bin/, the key
/// CPython's getpath reads) or `version` (the base interpreter's full version, which `python -m venv` writes).
std::string pyvenv_value(const std::string& cfg, const std::string& key) {
  std::string text;
  if (!read_file(cfg, text)) return {};
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    const auto eq = line.find('=');
    if (eq != std::string::npos && trim(line.substr(0, eq)) == key) return trim(line.substr(eq + 1));
  }
  return {};
}

}  // namespace

Environment find_environment() {
  const std::string ver = ACTIVEKV_PYTHON_VERSION;  // "3.11": the CPython minor version the launcher is built for
  Environment env;
  const std::string exe = self_path();
  env.bin_dir = exe.empty() ? "." : dirname(exe);
  env.prefix = dirname(env.bin_dir);
  env.base_prefix = env.prefix;
  // CPython looks for pyvenv.cfg next to the executable and one directory up; so do we.
  for (const auto& cfg : {join(env.bin_dir, "pyvenv.cfg"), join(env.prefix, "pyvenv.cfg")}) {
    if (!is_file(cfg)) continue;
    env.venv = true;
    const std::string home = pyvenv_value(cfg, "home");
    if (!home.empty()) env.base_prefix = dirname(home);
    env.version = pyvenv_value(cfg, "version");
    break;
  }
  for (const auto& name : {"python" + ver, std::string("python3"), std::string("python")}) {
    if (is_file(join(env.bin_dir, name))) {
      env.python = join(env.bin_dir, name);
      break;
    }
  }
  const std::string soname = "libpython" + ver + ".so.1.0";
  if (const char* forced = std::getenv("ACTIVEKV_LIBPYTHON"); forced != nullptr && *forced != '\0') {
    env.libpython = forced;
    env.libpython_source = "ACTIVEKV_LIBPYTHON";
  } else {
    for (const auto& dir : {join(env.base_prefix, "lib"), join(env.prefix, "lib")}) {
      if (is_file(join(dir, soname))) {
        env.libpython = join(dir, soname);
        env.libpython_source = dir;
        break;
      }
    }
    // A distribution's python (/usr/bin/python3.11) keeps libpython in the loader's default search path (Debian:
    // /usr/lib/x86_64-linux-gnu). That one may belong to another build of CPython than the environment's
    // (a pyenv python without --enable-shared next to Debian's libpython3.11): embed.cpp checks its version.
    if (env.libpython.empty()) {
      env.libpython = soname;
      env.libpython_source = "loader";
    }
  }
  const std::string lib = join(env.prefix, "lib/python" + ver);
  for (const auto& dir : {join(lib, "site-packages"), join(lib, "dist-packages"),
                          join(env.prefix, "local/lib/python" + ver + "/dist-packages")}) {
    if (is_dir(dir)) env.site_packages.push_back(dir);
  }
  for (const auto& site : env.site_packages) {
    if (is_dir(join(site, "activekv/patches"))) {
      env.package_dir = join(site, "activekv");
      break;
    }
  }
  return env;
}

std::string default_patch_dir(const Environment& env) {
  if (env.package_dir.empty()) return {};
  return join(env.package_dir, std::string("patches/vllm/v") + ACTIVEKV_VLLM_PATCH_VERSION);
}

namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

int version_main(const std::vector<std::string>& args, const Environment& env) {
  bool as_json = false;
  for (const auto& a : args) {
    if (a == "--json") {
      as_json = true;
    } else {
      std::fprintf(stderr, "usage: activekv version [--json]\nactivekv version: error: unrecognized argument: %s\n",
                   a.c_str());
      return 2;
    }
  }
  if (as_json) {
    std::printf("{\"activekv\": %s, \"torch\": %s, \"vllm\": %s, \"python\": %s, \"patches\": %s}\n",
                json_string(ACTIVEKV_VERSION).c_str(), json_string(ACTIVEKV_TORCH_VERSION).c_str(),
                json_string(ACTIVEKV_VLLM_PATCH_VERSION).c_str(), json_string(ACTIVEKV_PYTHON_VERSION).c_str(),
                json_string(default_patch_dir(env)).c_str());
  } else {
    std::printf("activekv %s\nbuilt against torch %s (CPython %s)\npatch series for vLLM %s\n", ACTIVEKV_VERSION,
                ACTIVEKV_TORCH_VERSION, ACTIVEKV_PYTHON_VERSION, ACTIVEKV_VLLM_PATCH_VERSION);
  }
  return 0;
}

const char* const kUsage =
    "usage: activekv {version,patch,serve,run-batch,plugins} ...\n"
    "\n"
    "  version [--json]                          engine version, the torch it was built against, the vLLM version\n"
    "                                            the patch series targets\n"
    "  patch apply|check|revert|status [--vllm DIR]\n"
    "                                            apply the vLLM patch series to the installed vLLM (or DIR)\n"
    "  serve MODEL [vllm serve options]          `vllm serve` with --attention-backend ACTIVEKV unless chosen, and\n"
    "                                            VLLM_PLUGINS allowing ActiveKV's endpoint plugin (see `plugins`)\n"
    "  plugins                                   print the VLLM_PLUGINS `serve` runs vLLM with, and why\n"
    "  run-batch [vllm run-batch options]        `vllm run-batch` likewise\n";

}  // namespace
}  // namespace activekv::launcher

int main(int argc, char** argv) {
  using namespace activekv::launcher;
  if (argc < 2 || std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "--help") == 0) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  const Environment env = find_environment();
  if (command == "serve" || command == "run-batch") {
    // Raw bytes: embed.cpp hands them to CPython, which decodes them as the interpreter decodes its own argv.
    return vllm_main(command, std::vector<const char*>(argv + 2, argv + argc), env);
  }
  const std::vector<std::string> rest(argv + 2, argv + argc);
  if (command == "version") return version_main(rest, env);
  if (command == "patch") return patch_main(rest, env);
  if (command == "plugins") {
    if (!rest.empty()) {
      std::fprintf(stderr, "activekv: error: `plugins` takes no arguments\n");
      return 2;
    }
    const char* current = std::getenv("VLLM_PLUGINS");
    const PluginsDecision d = plugins_allowlist(current, env);
    if (d.set) std::printf("VLLM_PLUGINS=%s\n", d.value.c_str());
    else if (current != nullptr) std::printf("VLLM_PLUGINS=%s (unchanged: it names activekv)\n", current);
    else std::printf("VLLM_PLUGINS unset (unchanged)\n");
    if (!d.warning.empty()) std::fputs(d.warning.c_str(), stderr);
    return 0;
  }
  std::fprintf(stderr, "%sactivekv: error: unknown command '%s'\n", kUsage, command.c_str());
  return 2;
}
