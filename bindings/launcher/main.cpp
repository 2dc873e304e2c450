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

const char* const kUsage = "usage: activekv [-h | --help] [-V | --version] COMMAND [ARGS]\n";

// What every command and the help name: ActiveKV's options (vLLM's additional_config["activekv"], read by the backend's
// Builder: bindings/modules/backend.cpp) and the environment variables ActiveKV reads (engine/, bindings/).
const char* const kOptionsHelp =
    "ActiveKV options: vLLM's --additional-config, a JSON object under the key \"activekv\"\n"
    "(Python: LLM(..., additional_config={\"activekv\": {...}})); unknown keys and bad values stop start-up:\n"
    "  activekv serve MODEL --additional-config '{\"activekv\": {\"mode\": \"exact\", \"pool_blocks\": 64}}'\n"
    "  mode             exact (default: every block) or compressed (decode rows beyond the budget attend\n"
    "                   sink + recent + top-k blocks per KV head)\n"
    "  placement        in_place (default on CPU without pool_blocks: blocks read where they are in vLLM's KV\n"
    "                   cache, no copy) or pool (blocks streamed through an active pool; the default on CUDA)\n"
    "  pool_blocks      active-pool slots per layer; implies placement pool (default 256; compressed: one\n"
    "                   worst-case selection per scheduled sequence, capped at the KV cache's blocks)\n"
    "  tile_blocks      blocks per attention tile (default 16, or pool_blocks where that is smaller; in place on the\n"
    "                   CPU, 2048 tokens' worth and at least 16)\n"
    "  kernel           native (default: the fast CPU kernel) or aten (the bit-exact ATen tile path)\n"
    "  budget_tokens    compressed: tokens a decode row attends per KV head (default 2048)\n"
    "  sink_blocks      compressed: first blocks always attended (default 1)\n"
    "  recent_blocks    compressed: last blocks always attended (default 2)\n"
    "  dense_layers     compressed: the first layers attend every block, as exact mode (default 0)\n"
    "  telemetry_json   a file path: the telemetry snapshot is written there as JSON at shutdown\n"
    "vLLM's own --block-size (Python: LLM(..., block_size=N)) must be 16, 32, 64 or 128 with ActiveKV, or a\n"
    "multiple of one (vLLM splits each block into kernel blocks of the largest that divides it; its default on the\n"
    "CPU: 128; exact mode decodes faster at 128 than at 16).\n";

const char* const kEnvironmentHelp =
    "environment:\n"
    "  ACTIVEKV_LIBPYTHON=PATH      the libpython serve and run-batch load (default: the environment's\n"
    "                               interpreter's, found through its pyvenv.cfg or prefix); it must be that\n"
    "                               interpreter's CPython build (pyvenv.cfg's version)\n"
    "  ACTIVEKV_SKIP_PATCH_CHECK=1  start without checking that vLLM carries the patch series (where git cannot\n"
    "                               run); 0 or unset: check\n"
    "  ACTIVEKV_PATCH_VERIFIED      set by serve and run-batch for vLLM's processes (what the launcher checked, so\n"
    "                               they skip git); never set it by hand\n"
    "  ACTIVEKV_TELEMETRY_DIR=DIR   base folder of the telemetry segments (default /dev/shm)\n"
    "  ACTIVEKV_CPU_AMX=0           the CPU kernel keeps bfloat16 KV off AMX tiles (default: AMX where present)\n"
    "  ACTIVEKV_CUDA_SPLIT=N        CUDA decode batch: 16-token sub-tiles per work item (1..64), for measuring the\n"
    "                               split; unset: the plan's own choice\n"
    "  ACTIVEKV_GATHER_CTAS=N       CUDA thread blocks of the pool's host-to-device block gather (1..1024), for\n"
    "                               measuring it; unset: 32\n"
    "  ACTIVEKV_DMA_MIN_BYTES=N     mean bytes per run of consecutive host-tier blocks from which that copy uses the\n"
    "                               copy engines instead (0 always, 2^50 never); unset: 1048576\n"
    "  ACTIVEKV_INLINE_IDS=N        most block ids a CUDA launch takes in its parameters instead of an uploaded\n"
    "                               index (0..256, 0 uploads every index), for measuring it; unset: 256\n"
    "  ATEN_CPU_CAPABILITY=CAP      caps the CPU kernel's instruction set (default, avx2, avx512) as it caps ATen's\n"
    "  VLLM_PLUGINS                 serve and run-batch add activekv to it (see `activekv plugins`)\n";

const char* const kExitHelp =
    "exit status: 0 done; 1 refused or failed (the message says why); 2 bad usage;\n"
    "serve and run-batch: vLLM's own exit status (1 when the launcher's check of vLLM refuses to start).\n";

void print_help(FILE* out) {
  std::fprintf(out,
               "%s\n"
               "ActiveKV %s: a native KV-cache engine for vLLM %s (the ACTIVEKV attention backend).\n"
               "\n"
               "commands:\n"
               "  version [--json]       ActiveKV's version, the torch it was built against, the vLLM version the\n"
               "                         patch series targets\n"
               "  patch apply|check|revert|status [--vllm DIR] [--patches DIR]\n"
               "                         apply the vLLM patch series to the installed vLLM (or DIR)\n"
               "  serve MODEL [ARGS]     `vllm serve` with --attention-backend ACTIVEKV unless one is chosen, and\n"
               "                         VLLM_PLUGINS allowing ActiveKV's endpoint plugin (see `plugins`)\n"
               "  run-batch [ARGS]       `vllm run-batch` likewise\n"
               "  plugins                print the VLLM_PLUGINS serve runs vLLM with, and why\n"
               "  help [COMMAND]         this help, or COMMAND's\n"
               "\n"
               "options:\n"
               "  -h, --help             this help (`activekv COMMAND --help`: the command's)\n"
               "  -V, --version          print ActiveKV's version and exit\n"
               "\n%s\n%s\n%s",
               kUsage, ACTIVEKV_VERSION, ACTIVEKV_VLLM_PATCH_VERSION, kOptionsHelp, kEnvironmentHelp, kExitHelp);
}

/// `activekv COMMAND --help` for the commands the launcher runs itself; false for a command it does not know.
bool print_command_help(const std::string& command) {
  if (command == "version") {
    std::fputs("usage: activekv version [--json]\n"
               "\n"
               "Print ActiveKV's version, the torch it was built against (and the CPython), the vLLM version the\n"
               "patch series targets. --json: one JSON object with those and the series folder the launcher found.\n"
               "Same as `activekv --version` in three lines.\n",
               stdout);
  } else if (command == "patch") {
    std::fputs("usage: activekv patch {apply,check,revert,status} [--vllm DIR] [--patches DIR]\n"
               "\n"
               "  apply    apply the patch series to the vLLM of this environment (refused, exit 1, when it is\n"
               "           already applied: `activekv patch check || activekv patch apply` applies it once)\n"
               "  check    exit 0 when the series is applied, 1 when not\n"
               "  revert   take the series out again\n"
               "  status   applied, not applied or partially applied, patch by patch\n"
               "  --vllm DIR      the vLLM to act on: a directory holding vllm/__init__.py (an installed package or a\n"
               "                  git checkout); default: the vllm package of this environment\n"
               "  --patches DIR   the series to use; default: the one installed with this launcher\n"
               "\n"
               "exit status: 0 done, 1 refused or failed (nothing changed; the message says why), 2 bad usage.\n",
               stdout);
  } else if (command == "plugins") {
    std::fputs("usage: activekv plugins\n"
               "\n"
               "Print the VLLM_PLUGINS value serve and run-batch run vLLM with (vLLM loads endpoint plugins only when\n"
               "named there): set, activekv is added; unset, every plugin vLLM would load anyway plus activekv.\n",
               stdout);
  } else if (command == "serve" || command == "run-batch") {
    // ActiveKV's part; vLLM's own help for the command follows (vllm_main with --help).
    std::printf("usage: activekv %s [ARGS]: `vllm %s` with ActiveKV\n"
                "\n"
                "Runs vLLM's CLI in this environment's CPython with --attention-backend ACTIVEKV unless another\n"
                "backend is chosen, after checking that vLLM carries the patch series (exit 1 when not: run\n"
                "`activekv patch apply`), and with VLLM_PLUGINS allowing ActiveKV's endpoint plugin.\n"
                "\n%s\n%s\n%s\nvLLM's help for `vllm %s` follows.\n\n",
                command.c_str(), command.c_str(), kOptionsHelp, kEnvironmentHelp, kExitHelp, command.c_str());
  } else if (command == "help") {
    std::fputs("usage: activekv help [COMMAND]\n\nPrint the help, or COMMAND's (same as `activekv COMMAND --help`).\n",
               stdout);
  } else {
    return false;
  }
  return true;
}

bool is_help(const char* a) { return std::strcmp(a, "-h") == 0 || std::strcmp(a, "--help") == 0; }

/// The commands `activekv help COMMAND` names (print_command_help's).
bool is_command(const std::string& c) {
  return c == "version" || c == "patch" || c == "plugins" || c == "serve" || c == "run-batch" || c == "help";
}

}  // namespace
}  // namespace activekv::launcher

int main(int argc, char** argv) {
  using namespace activekv::launcher;
  if (argc < 2) {
    std::fprintf(stderr, "%sactivekv: error: a command is required (activekv --help lists them)\n", kUsage);
    return 2;
  }
  const std::string command = argv[1];
  if (is_help(argv[1])) {
    print_help(stdout);
    return 0;
  }
  if (command == "-V" || command == "--version") {
    if (argc > 2) {
      std::fprintf(stderr, "%sactivekv: error: %s takes no arguments\n", kUsage, argv[1]);
      return 2;
    }
    std::printf("activekv %s (torch %s, CPython %s, patch series for vLLM %s)\n", ACTIVEKV_VERSION,
                ACTIVEKV_TORCH_VERSION, ACTIVEKV_PYTHON_VERSION, ACTIVEKV_VLLM_PATCH_VERSION);
    return 0;
  }
  if (command == "help") {
    if (argc == 2) {
      print_help(stdout);
      return 0;
    }
    if (is_help(argv[2])) return print_command_help("help") ? 0 : 2;
    if (argc == 3 && std::strcmp(argv[2], "serve") != 0 && std::strcmp(argv[2], "run-batch") != 0 &&
        print_command_help(argv[2])) {
      return 0;
    }
    if (!is_command(argv[2])) {
      std::fprintf(stderr, "usage: activekv help [COMMAND]\nactivekv: error: no such command: %s\n", argv[2]);
      return 2;
    }
    if (argc > 3) {
      std::fprintf(stderr, "usage: activekv help [COMMAND]\nactivekv: error: `help` takes one command name, got "
                   "extra arguments after %s (for `%s`'s own options: activekv %s --help)\n", argv[2], argv[2],
                   argv[2]);
      return 2;
    }
  }
  const Environment env = find_environment();
  if (command == "serve" || command == "run-batch" || command == "help") {
    // `activekv help serve` is `activekv serve --help`: ActiveKV's part here, then vLLM's own help.
    const bool via_help = command == "help";
    const std::string sub = via_help ? argv[2] : command;
    std::vector<const char*> args(argv + (via_help ? 3 : 2), argv + argc);
    if (via_help) args.push_back("--help");
    bool asks_help = false;
    for (const char* a : args) asks_help |= is_help(a) || std::strncmp(a, "--help=", 7) == 0;
    if (asks_help) {
      print_command_help(sub);
      std::fflush(stdout);
    }
    // Raw bytes: embed.cpp hands them to CPython, which decodes them as the interpreter decodes its own argv.
    return vllm_main(sub, args, env);
  }
  const std::vector<std::string> rest(argv + 2, argv + argc);
  for (const auto& a : rest) {
    if ((a == "-h" || a == "--help") && print_command_help(command)) return 0;
  }
  if (command == "version") return version_main(rest, env);
  if (command == "patch") return patch_main(rest, env);
  if (command == "plugins") {
    if (!rest.empty()) {
      std::fprintf(stderr, "usage: activekv plugins\nactivekv: error: `plugins` takes no arguments\n");
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
  std::fprintf(stderr, "%sactivekv: error: unknown command '%s' (activekv --help lists the commands)\n", kUsage,
               command.c_str());
  return 2;
}
