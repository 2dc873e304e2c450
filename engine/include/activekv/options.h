#pragma once
/// @file options.h
/// @brief The vLLM backend's options: additional_config['activekv'] and the KV-cache group a metadata builder serves,
///        as plain values, turned once into a validated EngineConfig (defaults, the compressed-mode default pool)
///        and the engine that serves the group.
///
/// The binding reads vLLM's Python objects into these values (type checks and conversions only); every default and
/// every check of a value is here, so a start-up message names the option the user wrote in one place.
#include <activekv/engine.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace activekv {

/// How an option's Python value is read: an int (its decimal digits), a str (UTF-8) or a file path (the bytes
/// os.fsencode() makes of a str, without NUL).
enum class OptionKind { kInt, kText, kPath };

/// The kind of option `name` of additional_config['activekv'].
/// @throws c10::ValueError "unknown ActiveKV option ..." naming every known option.
OptionKind option_kind(const std::string& name);

/// additional_config['activekv'] as the binding read it: option name -> value text (an int option's decimal digits,
/// a str option's UTF-8, telemetry_json's path bytes). Absent names take their defaults.
using OptionValues = std::map<std::string, std::string>;

/// What vLLM says about the KV-cache group one metadata builder serves.
struct KvCacheGroup {
  int64_t num_layers = 0;  ///< layer_names of the group
  int64_t num_heads = 0;   ///< model_config.get_num_attention_heads(parallel_config)
  int64_t num_kv_heads = 0, head_size = 0, block_size = 0;  ///< kv_cache_spec
  at::ScalarType dtype = at::kFloat;                          ///< kv_cache_spec.dtype
  int64_t max_num_seqs = -1;    ///< scheduler_config.max_num_seqs; -1 where vLLM's config lacks an int there
  int64_t num_gpu_blocks = -1;  ///< cache_config.num_gpu_blocks; likewise
  at::Device device = at::kCPU;  ///< the device the group's attention runs on (the engine's)
};

/// A builder's engine settings: the engine's configuration and where its telemetry JSON goes ("" for nowhere).
struct BackendConfig {
  EngineConfig engine;
  std::string telemetry_json;
};

/// Defaults: on the CPU, with neither pool_blocks nor placement given, placement in place (no pool: the host tier and a
/// pool would be the same memory); else a pool of 256 blocks per layer (exact mode; compressed mode's default pool is
/// compressed_default_pool). On CUDA, placement in place is taken when asked for: the KV cache then stays in the
/// device's memory (no host tier in pinned host memory). Tiles of 16 blocks, or of pool_blocks blocks where
/// pool_blocks alone is smaller; in place on the CPU, where a tile is only the online softmax's merge step (no pool to
/// fill), tiles of at least kCpuInPlaceTileTokens tokens (16 blocks at block 128, 128 at block 16).
inline constexpr int64_t kDefaultPoolBlocks = 256;
inline constexpr int64_t kDefaultTileBlocks = 16;
inline constexpr int64_t kCpuInPlaceTileTokens = 2048;

/// Compressed mode's default pool: the worst-case union of one row's selections for each of the scheduler's rows
/// (scheduler_config.max_num_seqs, as vLLM's own metadata builders read it), so a full batch's selections stay
/// resident together instead of evicting each other every step; capped by memory at the KV cache's block count
/// (cache_config.num_gpu_blocks, which vLLM's worker sets before it makes the metadata builders),
/// which no pool needs to exceed and which bounds the pool's bytes by the KV cache's; never below one row's union
/// (what the engine requires) or kDefaultPoolBlocks. Where either figure is < 1 (vLLM's config lacks it), one row's
/// union.
int64_t compressed_default_pool(int64_t union_blocks, int64_t max_num_seqs, int64_t num_gpu_blocks);

/// The validated settings of a builder (placement, pool and tile resolved as the defaults above say), every message
/// naming the option (additional_config['activekv'][...]) or, for an impossible geometry, the kv_cache_spec it came
/// from. Checks the telemetry_json path's folder (it must exist and be writable; the path must not be a directory)
/// now, not at shutdown where no one sees the error.
/// @throws c10::ValueError / c10::TypeError; the same the Engine constructor throws for the settings it checks.
BackendConfig backend_config(const OptionValues& options, const KvCacheGroup& group);

/// The block size of ActiveKV's kernels for vLLM's KV-cache block size, chosen as vLLM chooses it
/// (vllm/v1/worker/utils.py select_common_block_size): the cache's block size where ActiveKV supports it, else the
/// largest supported size that divides it (vLLM then splits each cache block into kernel blocks).
/// @throws c10::ValueError naming the supported sizes where none divides it.
int64_t kernel_block_size(int64_t cache_block_size);

/// How the options are checked when vLLM makes its configuration, in the user's process, before any engine core
/// starts: backend_config's checks and then the Engine constructor's (check_engine_config), building nothing; on the
/// CPU also that the pools (pool_blocks per layer) fit in the machine's memory, which the engine core would only find
/// by failing to allocate them after the model has loaded. The group is what the model's configuration says
/// (num_layers: its attention layers; num_gpu_blocks unknown, -1).
/// @throws c10::ValueError / c10::TypeError as backend_config and Engine's constructor.
void check_backend_options(const OptionValues& options, const KvCacheGroup& group);

/// The engine of one metadata builder: constructed from `config` (which the constructor validates), its telemetry
/// JSON path set and the group's layer names assigned to layer indices in order.
/// @throws as Engine's constructor and Engine::set_layer_names.
std::shared_ptr<Engine> make_backend_engine(const BackendConfig& config, const std::vector<std::string>& layer_names,
                                            at::Device device);

}  // namespace activekv
