// The vLLM backend's options (options.h): defaults, the checks of each value in the order a start-up meets them, the
// compressed-mode default pool, and the engine of one metadata builder.
#include <activekv/check.h>
#include <activekv/geometry.h>
#include <activekv/options.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cstring>
#include <limits>

namespace activekv {

namespace {

struct OptionSpec {
  const char* name;
  OptionKind kind;
};
// In the order the "known options" message lists them.
constexpr OptionSpec kOptions[] = {
    {"mode", OptionKind::kText},          {"pool_blocks", OptionKind::kInt},   {"tile_blocks", OptionKind::kInt},
    {"kernel", OptionKind::kText},        {"budget_tokens", OptionKind::kInt}, {"sink_blocks", OptionKind::kInt},
    {"recent_blocks", OptionKind::kInt},  {"dense_layers", OptionKind::kInt}, {"telemetry_json", OptionKind::kPath},
    {"placement", OptionKind::kText},
};

std::string option_label(const std::string& name) { return "additional_config['activekv']['" + name + "']"; }

// An int option in [lo, 2^40], or `dflt` where it is absent. The text is the Python int's decimal digits, so the
// message shows what the user wrote, however large.
int64_t option_int(const OptionValues& options, const std::string& name, int64_t dflt, int64_t lo = 0) {
  const auto it = options.find(name);
  if (it == options.end()) return dflt;
  const std::string& text = it->second;
  int64_t x = -1;
  const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), x);
  const bool parsed = err == std::errc() && end == text.data() + text.size();
  AKV_CHECK_VALUE(parsed && x >= lo && x <= (int64_t{1} << 40), option_label(name), " must be in [", lo,
                  ", 2^40], got ", text);
  return x;
}

// The telemetry_json path can be written at shutdown: a new file or a regular file this process may write, in an
// existing, writable folder. The write renames a new file over the path, which would replace whatever is there: a
// device (/dev/null), a FIFO or a symbolic link (the link, not its target) is refused here, by name.
void check_telemetry_json(const std::string& path) {
  const std::string label = option_label("telemetry_json");
  AKV_CHECK_VALUE(!path.empty() && path.back() != '/', label, " must be a file path, got '", path, "'");
  struct stat target {};
  if (::lstat(path.c_str(), &target) == 0) {
    // A directory would only fail at shutdown (the rename over it), where no one sees the error.
    AKV_CHECK_VALUE(!S_ISDIR(target.st_mode), label, " must name a file, got '", path, "' (an existing directory)");
    AKV_CHECK_VALUE(!S_ISLNK(target.st_mode), label, " must name a regular file, got '", path,
                    "' (a symbolic link: the snapshot would replace the link, not write its target; name the "
                    "target)");
    AKV_CHECK_VALUE(S_ISREG(target.st_mode), label, " must name a regular file, got '", path,
                    "' (a device, FIFO or socket: the snapshot would replace it)");
    AKV_CHECK_VALUE(::access(path.c_str(), W_OK) == 0, label, " must name a file this process may write, got '",
                    path, "' (", std::strerror(errno), ")");
  }
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  struct stat st {};
  AKV_CHECK_VALUE(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && ::access(dir.c_str(), W_OK) == 0,
                  "additional_config['activekv']['telemetry_json']: directory '", dir,
                  "' must exist and be writable, got '", path, "'");
  // The write at shutdown goes through a new file beside the path (telemetry_json.cpp): make one now and remove it,
  // so a folder that access() calls writable but takes no new file (/proc, a read-only mount as root) fails here.
  std::string probe = path + ".tmp.XXXXXX";
  const int fd = ::mkostemp(probe.data(), O_CLOEXEC);
  const int err = fd < 0 ? errno : 0;
  if (fd >= 0) {
    ::close(fd);
    ::unlink(probe.c_str());
  }
  AKV_CHECK_VALUE(fd >= 0, label, ": cannot create a file beside '", path, "' (", std::strerror(err),
                  "); the snapshot is written there at shutdown");
}

}  // namespace

OptionKind option_kind(const std::string& name) {
  for (const auto& o : kOptions)
    if (name == o.name) return o.kind;
  std::string known;
  for (const auto& o : kOptions) known += (known.empty() ? "" : ", ") + std::string(o.name);
  AKV_CHECK_VALUE(false, "unknown ActiveKV option ", option_label(name), "; known options: ", known);
  return OptionKind::kText;
}

int64_t compressed_default_pool(int64_t union_blocks, int64_t max_num_seqs, int64_t num_gpu_blocks) {
  const int64_t one_row = std::max(kDefaultPoolBlocks, union_blocks);
  if (max_num_seqs < 1 || num_gpu_blocks < 1) return one_row;
  const int64_t want = max_num_seqs > std::numeric_limits<int64_t>::max() / union_blocks
                           ? std::numeric_limits<int64_t>::max()
                           : max_num_seqs * union_blocks;
  return std::max(one_row, std::min(want, num_gpu_blocks));
}

BackendConfig backend_config(const OptionValues& options, const KvCacheGroup& group) {
  BackendConfig out;
  EngineConfig& cfg = out.engine;
  const auto text = [&](const char* name) {
    const auto it = options.find(name);
    return it == options.end() ? std::string() : it->second;
  };
  // The engine's own messages name the setting ("mode must be ..."); at start-up, name the option the user wrote.
  try {
    cfg.mode = parse_mode(options.count("mode") ? text("mode") : std::string("exact"));
    if (options.count("kernel")) cfg.kernel = parse_kernel(text("kernel"));
    if (options.count("placement")) cfg.placement = parse_placement(text("placement"));
  } catch (const c10::ValueError& e) {
    AKV_CHECK_VALUE(false, "additional_config['activekv']: ", e.what_without_backtrace());
  }
  // Placement: as given; else in place on the CPU unless pool_blocks asks for a pool.
  const bool pool_given = options.count("pool_blocks") != 0;
  if (!options.count("placement"))
    cfg.placement = group.device.is_cpu() && !pool_given ? Placement::kInPlace : Placement::kPool;
  if (cfg.placement == Placement::kInPlace) {
    AKV_CHECK_VALUE(!pool_given, option_label("placement"), " 'in_place' has no pool: drop ",
                    option_label("pool_blocks"), " or set placement 'pool'");
    AKV_CHECK_VALUE(group.device.is_cpu() || group.device.is_cuda(), option_label("placement"),
                    " 'in_place' needs the CPU or a CUDA device, got device ", group.device, "; set placement 'pool'");
  }
  const int64_t pool_blocks = option_int(options, "pool_blocks", -1, 1);  // -1: not given
  // A pool smaller than the default tile, with no tile given, takes tiles of the pool's size; in place on the CPU,
  // tiles of kCpuInPlaceTileTokens (block 16: prefill chunks of 512 keys instead of 256, fewer merges per decode row).
  int64_t default_tile = pool_given ? std::min(kDefaultTileBlocks, pool_blocks) : kDefaultTileBlocks;
  if (cfg.placement == Placement::kInPlace && group.device.is_cpu() && group.block_size > 0)
    default_tile = std::max(default_tile, kCpuInPlaceTileTokens / group.block_size);
  const int64_t tile_blocks = option_int(options, "tile_blocks", default_tile, 1);
  // Name where an impossible geometry came from: the model's KV-cache spec, not an argument the user typed.
  const auto from = c10::str("kv_cache_spec (block_size ", group.block_size, ", num_kv_heads ", group.num_kv_heads,
                             ", head_size ", group.head_size, ", dtype ", group.dtype, ") with num_heads ",
                             group.num_heads, ": ");
  try {
    cfg.geometry = Geometry(group.num_layers, group.num_heads, group.num_kv_heads, group.head_size, group.block_size,
                            group.dtype, tile_blocks);
  } catch (const c10::TypeError& e) {
    C10_THROW_ERROR(TypeError, from + e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    C10_THROW_ERROR(ValueError, from + e.what_without_backtrace());
  }
  // Options only compressed mode reads: given in exact mode they would be ignored, so the user's intent is unclear.
  if (cfg.mode != Mode::kCompressed) {
    for (const char* name : {"budget_tokens", "sink_blocks", "recent_blocks", "dense_layers"}) {
      AKV_CHECK_VALUE(!options.count(name), option_label(name), " applies to mode 'compressed' only, got it with mode "
                      "'exact': set ", option_label("mode"), " to 'compressed' or drop it");
    }
  }
  cfg.budget_tokens = option_int(options, "budget_tokens", cfg.budget_tokens);
  cfg.sink_blocks = option_int(options, "sink_blocks", cfg.sink_blocks);
  cfg.recent_blocks = option_int(options, "recent_blocks", cfg.recent_blocks);
  cfg.dense_layers = option_int(options, "dense_layers", cfg.dense_layers);
  AKV_CHECK_VALUE(cfg.dense_layers <= group.num_layers, option_label("dense_layers"), " must be in [0, ",
                  group.num_layers, "] (the model's attention layers), got ", cfg.dense_layers);
  if (cfg.placement == Placement::kInPlace) {
    cfg.pool_blocks = 0;
    if (cfg.mode == Mode::kCompressed) worst_case_union_blocks(cfg);  // the budget's checks, as a pool's default
  } else if (pool_given) {
    cfg.pool_blocks = pool_blocks;
  } else {
    cfg.pool_blocks =
        cfg.mode == Mode::kCompressed
            ? compressed_default_pool(worst_case_union_blocks(cfg), group.max_num_seqs, group.num_gpu_blocks)
            : kDefaultPoolBlocks;
  }
  if (options.count("telemetry_json")) {
    out.telemetry_json = text("telemetry_json");
    check_telemetry_json(out.telemetry_json);
  }
  return out;
}

int64_t kernel_block_size(int64_t cache_block_size) {
  // The largest supported size dividing it: the cache's own where supported (no larger size divides it).
  const auto sizes = supported_block_sizes();
  int64_t best = 0;
  for (const auto b : sizes)
    if (cache_block_size > 0 && cache_block_size % b == 0) best = std::max(best, b);
  if (best > 0) return best;
  std::string list;
  for (const auto b : sizes) list += (list.empty() ? "" : ", ") + std::to_string(b);
  AKV_CHECK_VALUE(false, "ActiveKV's kernels take KV blocks of ", list, " tokens: the KV cache's block_size must be "
                  "one of them or a multiple of one, got ", cache_block_size);
  return 0;
}

void check_backend_options(const OptionValues& options, const KvCacheGroup& group) {
  const EngineConfig cfg = backend_config(options, group).engine;
  check_pools_fit_memory(cfg.geometry, cfg.pool_blocks, group.device, option_label("pool_blocks"));  // named first
  check_engine_config(cfg, group.device);
}

std::shared_ptr<Engine> make_backend_engine(const BackendConfig& config, const std::vector<std::string>& layer_names,
                                            at::Device device) {
  auto engine = std::make_shared<Engine>(config.engine, device);
  if (!config.telemetry_json.empty()) engine->telemetry().set_json_path(config.telemetry_json);
  engine->set_layer_names(layer_names);
  return engine;
}

}  // namespace activekv
