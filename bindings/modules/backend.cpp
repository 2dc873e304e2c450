// activekv._backend: the engine and the vLLM-facing backend objects (engine/include/activekv/engine.h).
//
// vLLM's patched Python (vllm/v1/attention/backends/activekv.py) imports this module and delegates each contract
// method in one line. This file reads vLLM's objects (attributes only, plus one config method at start-up) and never
// imports a Python module or calls a Python callable on the per-step path. At start-up (the first Impl or Builder)
// it checks, once per process, that the vLLM the process imported carries this wheel's patch series
// (bindings/series/patch_series.h, the check `activekv serve` runs before Python starts; under the launcher, its
// ACTIVEKV_PATCH_VERIFIED spares git when it names this very tree, series and file state).
#include <activekv/cpu_kernel.h>
#include <activekv/engine.h>
#include <activekv_py/common.h>
#include <activekv_py/host_tier.h>
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>
#include <vector>

#include "patch_series.h"

namespace py = pybind11;
using activekv::Engine;
using activekv::StepPlan;

namespace {

// A StepPlan bound to the engine that built it: the attention metadata object vLLM passes to every layer's forward.
struct PlanHandle {
  std::shared_ptr<Engine> engine;
  StepPlan plan;
};

// vLLM hands do_kv_cache_update the layer but no metadata: find the layer's engine by vLLM layer name, registered
// by the metadata builder that owns the layer. Two LLMs in one process register the same names (every Llama has
// model.layers.N.self_attn.attn), so a name may map to several live engines: the one serving this KV cache is the one
// whose layer is bound to this tensor (bound at its first KV update); a cache no engine has bound yet belongs to the
// one engine whose layer is still unbound. Anything else is ambiguous and an error, never a guess.
std::mutex g_layers_mu;
std::unordered_map<std::string, std::vector<std::weak_ptr<Engine>>> g_layers;

std::vector<std::shared_ptr<Engine>> live_engines_for(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_layers_mu);
  std::vector<std::shared_ptr<Engine>> out;
  auto it = g_layers.find(name);
  if (it == g_layers.end()) return out;
  auto& v = it->second;
  v.erase(std::remove_if(v.begin(), v.end(), [](const std::weak_ptr<Engine>& w) { return w.expired(); }), v.end());
  for (auto& w : v)
    if (auto e = w.lock()) out.push_back(std::move(e));
  return out;
}

// Among several live engines for one layer name, the one this KV cache identifies: the engine whose layer is bound
// to this very tensor, else the one engine whose layer is still unbound; nullptr when neither names exactly one.
std::shared_ptr<Engine> identified_by_cache(const std::vector<std::shared_ptr<Engine>>& engines,
                                            const std::string& name, const at::Tensor& kv_cache) {
  std::shared_ptr<Engine> bound, unbound;
  int64_t n_bound = 0, n_unbound = 0;
  for (auto& e : engines) {
    const auto binding = e->host_binding(e->layer_index(name), kv_cache);
    if (binding == Engine::HostBinding::kUnbound) {
      unbound = e;
      ++n_unbound;
    } else if (binding == Engine::HostBinding::kThis) {
      bound = e;
      ++n_bound;
    }
  }
  if (n_bound == 1) return bound;
  if (n_bound == 0 && n_unbound == 1) return unbound;
  return nullptr;
}

std::shared_ptr<Engine> engine_for_layer(const std::string& name, const at::Tensor& kv_cache) {
  auto engines = live_engines_for(name);
  TORCH_CHECK_VALUE(!engines.empty(), "no ActiveKV engine serves layer '", name,
                    "': the ActiveKV metadata builder for its KV-cache group was not created or was released");
  if (engines.size() == 1) return engines.front();
  auto engine = identified_by_cache(engines, name, kv_cache);
  TORCH_CHECK(engine, "layer '", name, "' is served by ", engines.size(),
              " live ActiveKV engines and this KV cache does not identify one of them");
  return engine;
}

void register_layers(const std::shared_ptr<Engine>& engine, const std::vector<std::string>& names) {
  std::lock_guard<std::mutex> lock(g_layers_mu);
  for (const auto& n : names) g_layers[n].push_back(engine);
}

// A Python value as T, or a TypeError naming it (`what`), the type expected and the value that came: pybind11's own
// cast_error says neither ("Unable to cast Python instance of type ... to C++ type '?'").
template <typename T>
T cast_named(const py::handle& v, const std::string& what, const char* expected) {
  try {
    return v.cast<T>();
  } catch (const py::cast_error&) {
    C10_THROW_ERROR(TypeError, c10::str(what, " must be ", expected, ", got ", std::string(py::repr(v))));
  }
}

// Attribute `name` of a vLLM object (`owner` in messages) as T: a named TypeError if it is missing or of another type.
template <typename T>
T attr_as(const py::handle& obj, const char* owner, const char* name, const char* expected) {
  TORCH_CHECK_TYPE(py::hasattr(obj, name), owner, ".", name, " is missing (expected ", expected, "), got a ",
                   std::string(py::str(py::type::of(obj))));
  return cast_named<T>(obj.attr(name), std::string(owner) + "." + name, expected);
}

// A Python str as UTF-8, or a named error: TypeError for another type, ValueError for a str that UTF-8 cannot hold (a
// lone surrogate), where pybind11's own cast says "Unable to cast ... to C++ type '?'".
std::string utf8_str(const py::handle& v, const std::string& what) {
  TORCH_CHECK_TYPE(py::isinstance<py::str>(v), what, " must be a str, got ", std::string(py::repr(v)));
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(v.ptr(), &size);
  if (data == nullptr) {
    PyErr_Clear();
    C10_THROW_ERROR(ValueError, c10::str(what, " must be text UTF-8 can encode, got ", std::string(py::repr(v)),
                                         " (it holds a lone surrogate)"));
  }
  return std::string(data, static_cast<size_t>(size));
}

std::string layer_name(const py::handle& layer) {
  TORCH_CHECK_TYPE(py::hasattr(layer, "layer_name"), "layer must be a vLLM attention layer with a layer_name, got ",
                   std::string(py::str(py::type::of(layer))));
  return utf8_str(layer.attr("layer_name"), "layer.layer_name");
}

const std::set<std::string>& builder_option_keys() {
  static const std::set<std::string> keys{"mode",          "pool_blocks", "tile_blocks",  "kernel",
                                          "budget_tokens", "sink_blocks", "recent_blocks", "telemetry_json"};
  return keys;
}

// Defaults: a pool of 256 blocks per layer, tiles of 16 blocks.
constexpr int64_t kDefaultPoolBlocks = 256;
constexpr int64_t kDefaultTileBlocks = 16;

int64_t option_int(const py::dict& opts, const char* key, int64_t dflt) {
  if (!opts.contains(key)) return dflt;
  py::object v = opts[key];
  TORCH_CHECK_TYPE(py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v), "additional_config['activekv']['",
                   key, "'] must be an int, got ", std::string(py::repr(v)));
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  TORCH_CHECK_VALUE(overflow == 0 && x >= 0 && x <= (int64_t{1} << 40), "additional_config['activekv']['", key,
                    "'] must be in [0, 2^40], got ", std::string(py::repr(v)));
  return x;
}

// Read additional_config["activekv"]: a dict whose keys are all known.
// vLLM types additional_config as `dict | SupportsHash`: a dict is read; an object of another kind that is no
// mapping belongs to someone else and carries no ActiveKV options; a mapping of another type (MappingProxyType, ...)
// that names "activekv" is refused rather than silently ignored. Start-up only.
py::dict activekv_options(const py::handle& vllm_config) {
  py::object extra = vllm_config.attr("additional_config");
  if (extra.is_none()) return py::dict();
  if (!py::isinstance<py::dict>(extra)) {
    const bool mapping = py::hasattr(extra, "keys") && py::hasattr(extra, "__getitem__") &&
                         py::hasattr(extra, "__contains__");
    TORCH_CHECK_TYPE(!mapping || !extra.attr("__contains__")("activekv").cast<bool>(),
                     "additional_config must be a dict to carry ActiveKV options, got a ",
                     std::string(py::str(py::type::of(extra))));
    return py::dict();
  }
  py::dict d = extra.cast<py::dict>();
  if (!d.contains("activekv")) return py::dict();
  py::object opts = d["activekv"];
  TORCH_CHECK_TYPE(py::isinstance<py::dict>(opts), "additional_config['activekv'] must be a dict, got ",
                   std::string(py::repr(opts)));
  py::dict od = opts.cast<py::dict>();
  for (auto item : od) {
    const auto key = utf8_str(item.first, "an additional_config['activekv'] key");
    TORCH_CHECK_VALUE(builder_option_keys().count(key), "unknown ActiveKV option additional_config['activekv']['",
                      key, "']; known options: mode, pool_blocks, tile_blocks, kernel, budget_tokens, sink_blocks, "
                      "recent_blocks, telemetry_json");
  }
  return od;
}

// ---- start-up check: the vLLM this process imported carries this wheel's patch series ----

/// Where the wheel installs the series: <package dir>/patches/vllm/v<version> next to this extension module
/// (CMakeLists.txt installs both under activekv/; the launcher's default_patch_dir is the same folder). The module's
/// file comes from the loader (dladdr on one of its functions), not from Python.
std::string installed_patch_dir() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&installed_patch_dir), &info) == 0 || info.dli_fname == nullptr) return {};
  return activekv::series::join(activekv::series::dirname(info.dli_fname),
                                "patches/vllm/v" + activekv::series::series_vllm_version());
}

/// The series in `patch_dir` (installed_patch_dir() or a caller's), read from its real path. Throws PatchError when
/// there is no such directory (the message says the wheel's series is missing) or Series::load refuses it.
activekv::series::Series load_series(const std::string& patch_dir) {
  namespace s = activekv::series;
  if (patch_dir.empty() || !s::is_dir(patch_dir)) {
    throw s::PatchError("this ActiveKV's patch series is not installed next to its _backend module (expected " +
                        (patch_dir.empty() ? std::string("<activekv>/patches") : patch_dir) +
                        "); reinstall the ActiveKV wheel");
  }
  return s::Series::load(s::real_path(patch_dir));
}

/// The series in `patch_dir` compared with the vLLM tree at `vllm_dir` (the directory holding vllm/, or the vllm
/// package directory). Runs git; no GIL needed. Throws PatchError when the check itself cannot run.
activekv::series::Check check_tree(const std::string& vllm_dir, const std::string& patch_dir) {
  return activekv::series::check_series(activekv::series::resolve_tree(vllm_dir), load_series(patch_dir));
}

/// The check of the tree at `vllm_dir` against the series in `patch_dir`, and "" when the tree carries the series, else
/// the one message for RuntimeError (what was expected, what was found, the fix); `where` names the tree in its head.
struct SeriesVerdict {
  activekv::series::Check check;
  std::string problem;
  bool ran = false;  // false: the check itself could not run (no vllm there, no series, git missing)
};

SeriesVerdict series_verdict(const std::string& vllm_dir, const std::string& patch_dir, const std::string& where) {
  SeriesVerdict v;
  try {
    v.check = check_tree(vllm_dir, patch_dir);
    v.ran = true;
    const std::string why = activekv::series::startup_problem(v.check);
    if (!why.empty()) v.problem = "the ACTIVEKV attention backend cannot run on " + where + ": " + why;
  } catch (const activekv::series::PatchError& e) {
    v.problem = "cannot check that ActiveKV's patch series is applied to " + where + " (" + vllm_dir + "): " + e.what();
  }
  return v;
}

// The verdict of the first check, kept for the process: the vLLM modules already imported do not change when the
// files on disk do, so a fix takes effect only in a new process anyway.
std::mutex g_series_mu;
bool g_series_checked = false;
std::string g_series_problem;

/// What the launcher's ACTIVEKV_PATCH_VERIFIED (series::kVerifiedVar) means for the tree at `vllm_dir` and the series
/// in `patch_dir`: "" when it vouches for exactly them (same build's vLLM version, tree, series and file state), else
/// why not (for the message should this process's own check fail). Reads files, runs no git. A tree or series that
/// cannot be read is "not vouched for": the check that follows says what is wrong with it.
std::string marker_mismatch(const activekv::series::Verified& marker, const std::string& vllm_dir,
                            const std::string& patch_dir) {
  namespace s = activekv::series;
  try {
    return s::verified_mismatch(marker, s::verified_now(s::tree_root(vllm_dir), load_series(patch_dir)));
  } catch (const s::PatchError& e) {
    return std::string("a tree and series that cannot be compared here (") + e.what() + ")";
  }
}

// The escape hatch: "1" starts without the check. For environments that cannot run it, chiefly where git is not
// installed (docs/vllm_support.md applies the series with patch(1) there); the user then vouches for the series.
constexpr const char* kSkipCheckVar = "ACTIVEKV_SKIP_PATCH_CHECK";

/// Why the ACTIVEKV backend cannot run here ("" when it can): the vLLM this process imported
/// (sys.modules['vllm'].__file__) does not carry this wheel's patch series (another vLLM version, a series not or only
/// partly applied, files changed, another release's series), or that cannot be checked. Decided once per process;
/// later calls repeat the first verdict. No vLLM in sys.modules (the bindings driven directly, as the tests and tools
/// do): nothing to compare, "". ACTIVEKV_SKIP_PATCH_CHECK=1 skips the check. ACTIVEKV_PATCH_VERIFIED (exported by
/// `activekv serve` after its own check passed) skips git when it names this tree, the series installed next to this
/// module and their files' state as they are now; a value of another form is itself the problem. Reads sys.modules
/// and the environment, imports nothing; git runs without the GIL.
std::string patched_vllm_problem() {
  {
    std::lock_guard<std::mutex> lock(g_series_mu);
    if (g_series_checked) return g_series_problem;
  }
  PyObject* modules = PySys_GetObject("modules");  // borrowed
  PyObject* vllm = modules != nullptr && PyDict_Check(modules) ? PyDict_GetItemString(modules, "vllm") : nullptr;
  if (vllm == nullptr) return "";
  const char* skip_env = std::getenv(kSkipCheckVar);
  const std::string skip = skip_env != nullptr ? skip_env : "";
  // The launcher's marker, parsed before anything is compared: a value of another form is an error, never "no marker".
  std::optional<activekv::series::Verified> marker;
  std::string marker_error;
  if (const char* marker_env = std::getenv(activekv::series::kVerifiedVar); marker_env && *marker_env != '\0') {
    try {
      marker = activekv::series::parse_verified(marker_env);
    } catch (const activekv::series::PatchError& e) {
      marker_error = e.what();
    }
  }
  const py::object file = py::getattr(py::handle(vllm), "__file__", py::none());
  const std::string init = py::isinstance<py::str>(file) ? file.cast<std::string>() : std::string();
  const std::string file_repr = std::string(py::repr(file));
  std::string problem;
  {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(g_series_mu);
    if (!g_series_checked) {
      const std::string hatch = std::string(". Set ") + kSkipCheckVar + "=1 to start without this check (where it "
                                "cannot run, e.g. without git) only if the vLLM there carries this ActiveKV's series";
      if (skip == "1") {
        g_series_problem.clear();
      } else if (!skip.empty() && skip != "0") {
        g_series_problem = std::string(kSkipCheckVar) + " must be 1 (start without the patch series check) or 0, "
                           "got '" + skip + "'";
      } else if (init.empty()) {
        g_series_problem = "cannot check that ActiveKV's patch series is applied to the vLLM this process imported: "
                           "sys.modules['vllm'] has no __file__ (got " + file_repr + ")" + hatch;
      } else if (!marker_error.empty()) {
        g_series_problem = marker_error;  // refused, as a malformed ACTIVEKV_SKIP_PATCH_CHECK is
      } else {
        const std::string vllm_dir = activekv::series::dirname(init);
        const std::string patch_dir = installed_patch_dir();
        const std::string why_not = marker ? marker_mismatch(*marker, vllm_dir, patch_dir) : std::string();
        if (marker && why_not.empty()) {
          g_series_problem.clear();  // `activekv serve` checked this very tree, series and file state: no git here
        } else {
          const SeriesVerdict v = series_verdict(vllm_dir, patch_dir, "the vLLM this process imported");
          const std::string note = marker ? std::string(" (") + activekv::series::kVerifiedVar +
                                                " did not spare this check: it names " + why_not + ")"
                                          : std::string();
          g_series_problem = v.problem.empty() ? "" : (v.ran ? v.problem : v.problem + hatch) + note;
        }
      }
      g_series_checked = true;
    }
    problem = g_series_problem;
  }
  return problem;
}

/// Raises RuntimeError with patched_vllm_problem() when there is one (the first Impl / Builder of a process).
void require_patched_vllm() {
  const std::string problem = patched_vllm_problem();
  TORCH_CHECK(problem.empty(), problem);
}

struct Impl {
  int64_t num_heads;
  int64_t head_size;
  double scale;
  int64_t num_kv_heads;
  std::string kv_cache_dtype;
  std::string attn_type;
};

Impl make_impl(int64_t num_heads, int64_t head_size, double scale, py::object num_kv_heads, py::object alibi_slopes,
               py::object sliding_window, const std::string& kv_cache_dtype, py::object logits_soft_cap,
               py::object attn_type, py::object kv_sharing_target_layer_name, py::object sinks) {
  require_patched_vllm();  // vLLM builds every attention layer's Impl at model construction, before the Builders
  TORCH_CHECK_VALUE(std::isfinite(scale), "scale must be a finite number, got ", scale);
  TORCH_CHECK_NOT_IMPLEMENTED(alibi_slopes.is_none(), "ActiveKV does not support ALiBi slopes");
  TORCH_CHECK_NOT_IMPLEMENTED(sliding_window.is_none(), "ActiveKV does not support sliding-window attention, got ",
                              std::string(py::repr(sliding_window)));
  TORCH_CHECK_NOT_IMPLEMENTED(kv_cache_dtype == "auto", "ActiveKV supports kv_cache_dtype 'auto' only, got '",
                              kv_cache_dtype, "'");
  TORCH_CHECK_NOT_IMPLEMENTED(logits_soft_cap.is_none() ||
                                  cast_named<double>(logits_soft_cap, "logits_soft_cap", "a float or None") == 0.0,
                              "ActiveKV does not support logits soft-capping, got ",
                              std::string(py::repr(logits_soft_cap)));
  const std::string at =
      attn_type.is_none() ? "decoder" : cast_named<std::string>(attn_type, "attn_type", "a str (AttentionType)");
  TORCH_CHECK_NOT_IMPLEMENTED(at == "decoder", "ActiveKV supports decoder attention only, got '", at, "'");
  TORCH_CHECK_NOT_IMPLEMENTED(kv_sharing_target_layer_name.is_none(),
                              "ActiveKV does not support KV sharing across layers, got ",
                              std::string(py::repr(kv_sharing_target_layer_name)));
  TORCH_CHECK_NOT_IMPLEMENTED(sinks.is_none(), "ActiveKV does not support attention sinks");
  const int64_t kvh =
      num_kv_heads.is_none() ? num_heads : cast_named<int64_t>(num_kv_heads, "num_kv_heads", "an int or None");
  TORCH_CHECK_VALUE(num_heads > 0 && kvh > 0 && num_heads % kvh == 0,
                    "num_heads must be a positive multiple of num_kv_heads, got ", num_heads, " and ", kvh);
  const auto sizes = activekv::supported_head_sizes();
  TORCH_CHECK_NOT_IMPLEMENTED(std::find(sizes.begin(), sizes.end(), head_size) != sizes.end(),
                              "ActiveKV's vLLM backend supports head sizes ", c10::IntArrayRef(sizes), ", got ",
                              head_size);
  return Impl{num_heads, head_size, scale, kvh, kv_cache_dtype, at};
}

// An int attribute at obj.a.b, or -1 where either is missing or not an int (start-up only).
int64_t int_attr_or(py::handle obj, const char* a, const char* b) {
  if (!py::hasattr(obj, a)) return -1;
  py::object inner = obj.attr(a);
  if (inner.is_none() || !py::hasattr(inner, b)) return -1;
  py::object v = inner.attr(b);
  if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v)) return -1;
  return v.cast<int64_t>();
}

// Compressed mode's default pool: the worst-case union of one row's selections for each of the scheduler's rows
// (vllm_config.scheduler_config.max_num_seqs, as vLLM's own metadata builders read it, e.g.
// vllm/v1/attention/backends/b12x.py:412), so a full batch's selections stay resident together instead of evicting
// each other every step; capped by memory at the KV cache's block count (vllm_config.cache_config.num_gpu_blocks,
// set before the metadata builders are made: vllm/v1/worker/gpu_worker.py:857), which no pool needs to exceed and
// which bounds the pool's bytes by the KV cache's; never below one row's union (what the engine requires) or 256.
// Where vLLM's config lacks either figure, one row's union.
int64_t compressed_default_pool(int64_t union_blocks, py::handle vllm_config) {
  const int64_t one_row = std::max(kDefaultPoolBlocks, union_blocks);
  const int64_t seqs = int_attr_or(vllm_config, "scheduler_config", "max_num_seqs");
  const int64_t kv_blocks = int_attr_or(vllm_config, "cache_config", "num_gpu_blocks");
  if (seqs < 1 || kv_blocks < 1) return one_row;
  const int64_t want = seqs > std::numeric_limits<int64_t>::max() / union_blocks ? std::numeric_limits<int64_t>::max()
                                                                                  : seqs * union_blocks;
  return std::max(one_row, std::min(want, kv_blocks));
}

std::shared_ptr<Engine> make_builder_engine(py::handle kv_cache_spec, const std::vector<std::string>& layer_names,
                                            py::handle vllm_config, at::Device device) {
  const auto block_size = attr_as<int64_t>(kv_cache_spec, "kv_cache_spec", "block_size", "an int");
  const auto num_kv_heads = attr_as<int64_t>(kv_cache_spec, "kv_cache_spec", "num_kv_heads", "an int");
  const auto head_size = attr_as<int64_t>(kv_cache_spec, "kv_cache_spec", "head_size", "an int");
  const auto dtype = attr_as<at::ScalarType>(kv_cache_spec, "kv_cache_spec", "dtype", "a torch.dtype");
  if (py::hasattr(kv_cache_spec, "sliding_window")) {
    TORCH_CHECK_NOT_IMPLEMENTED(kv_cache_spec.attr("sliding_window").is_none(),
                                "ActiveKV does not support sliding-window KV-cache groups");
  }
  // Start-up only: the one config method vLLM offers for the per-rank query head count.
  py::object model_config = vllm_config.attr("model_config");
  const auto num_heads =
      cast_named<int64_t>(model_config.attr("get_num_attention_heads")(vllm_config.attr("parallel_config")),
                          "model_config.get_num_attention_heads(parallel_config)", "an int");
  py::dict opts = activekv_options(vllm_config);
  std::map<std::string, std::string> text;  // the str options, as UTF-8
  for (const char* key : {"mode", "kernel"})
    if (opts.contains(key)) text[key] = utf8_str(opts[key], c10::str("additional_config['activekv']['", key, "']"));
  if (opts.contains("telemetry_json"))  // a path: read below as os.fsencode reads it (undecodable bytes are valid)
    TORCH_CHECK_TYPE(py::isinstance<py::str>(opts["telemetry_json"]),
                     "additional_config['activekv']['telemetry_json'] must be a str, got ",
                     std::string(py::repr(opts["telemetry_json"])));
  const std::string mode = text.count("mode") ? text["mode"] : "exact";
  activekv::EngineConfig cfg;
  // The engine's own messages name the setting ("mode must be ..."); at start-up, name the option the user wrote.
  try {
    cfg.mode = activekv::parse_mode(mode);
    if (text.count("kernel")) cfg.kernel = activekv::parse_kernel(text["kernel"]);
  } catch (const c10::ValueError& e) {
    TORCH_CHECK_VALUE(false, "additional_config['activekv']: ", e.what_without_backtrace());
  }
  const int64_t tile_blocks = option_int(opts, "tile_blocks", kDefaultTileBlocks);
  TORCH_CHECK_VALUE(tile_blocks >= 1, "additional_config['activekv']['tile_blocks'] must be >= 1, got ",
                    tile_blocks);
  // Name where an impossible geometry came from: the model's KV-cache spec, not an argument the user typed.
  const auto from = c10::str("kv_cache_spec (block_size ", block_size, ", num_kv_heads ", num_kv_heads,
                             ", head_size ", head_size, ", dtype ", dtype, ") with num_heads ", num_heads, ": ");
  try {
    cfg.geometry = activekv::Geometry(static_cast<int64_t>(layer_names.size()), num_heads, num_kv_heads, head_size,
                                      block_size, dtype, tile_blocks);
  } catch (const c10::TypeError& e) {
    C10_THROW_ERROR(TypeError, from + e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    C10_THROW_ERROR(ValueError, from + e.what_without_backtrace());
  }
  cfg.budget_tokens = option_int(opts, "budget_tokens", cfg.budget_tokens);
  cfg.sink_blocks = option_int(opts, "sink_blocks", cfg.sink_blocks);
  cfg.recent_blocks = option_int(opts, "recent_blocks", cfg.recent_blocks);
  const int64_t default_pool = cfg.mode == activekv::Mode::kCompressed
                                   ? compressed_default_pool(activekv::worst_case_union_blocks(cfg), vllm_config)
                                   : kDefaultPoolBlocks;
  cfg.pool_blocks = option_int(opts, "pool_blocks", default_pool);
  TORCH_CHECK_VALUE(cfg.pool_blocks >= 1, "additional_config['activekv']['pool_blocks'] must be >= 1, got ",
                    cfg.pool_blocks);
  std::string telemetry_json;
  if (opts.contains("telemetry_json")) {
    // A path's bytes as Python's os functions would use them (a name of undecodable bytes is a valid path).
    const auto bytes = activekv::py_glue::fs_path_of(opts["telemetry_json"]);
    TORCH_CHECK_VALUE(bytes.has_value(),
                      "additional_config['activekv']['telemetry_json'] must be a path os.fsencode() can encode, got ",
                      std::string(py::repr(opts["telemetry_json"])));
    telemetry_json = *bytes;
    // The C library reads a path up to its first NUL: '/tmp/run\0.json' would check and write '/tmp/run'.
    TORCH_CHECK_VALUE(telemetry_json.find('\0') == std::string::npos,
                      "additional_config['activekv']['telemetry_json'] must be a file path without NUL characters, "
                      "got ",
                      std::string(py::repr(opts["telemetry_json"])));
    TORCH_CHECK_VALUE(!telemetry_json.empty() && telemetry_json.back() != '/',
                      "additional_config['activekv']['telemetry_json'] must be a file path, got '", telemetry_json,
                      "'");
    struct stat target {};
    // A directory would only fail at shutdown (the rename over it), where no one sees the error.
    TORCH_CHECK_VALUE(::stat(telemetry_json.c_str(), &target) != 0 || !S_ISDIR(target.st_mode),
                      "additional_config['activekv']['telemetry_json'] must name a file, got '", telemetry_json,
                      "' (an existing directory)");
    const auto slash = telemetry_json.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : telemetry_json.substr(0, slash);
    struct stat st {};
    TORCH_CHECK_VALUE(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && ::access(dir.c_str(), W_OK) == 0,
                      "additional_config['activekv']['telemetry_json']: directory '", dir,
                      "' must exist and be writable, got '", telemetry_json, "'");
  }
  auto engine = std::make_shared<Engine>(cfg, device);
  if (!telemetry_json.empty()) engine->telemetry().set_json_path(telemetry_json);
  engine->set_layer_names(layer_names);
  register_layers(engine, layer_names);
  return engine;
}

struct Builder {
  std::shared_ptr<Engine> engine;
};

at::Tensor cpu_attr(py::handle obj, const char* primary, const char* fallback) {
  py::object v = py::none();
  if (py::hasattr(obj, primary)) v = obj.attr(primary);
  if (!v.is_none()) return cast_named<at::Tensor>(v, std::string("common_attn_metadata.") + primary, "a tensor");
  return attr_as<at::Tensor>(obj, "common_attn_metadata", fallback, "a tensor");
}

}  // namespace

PYBIND11_MODULE(_backend, m) {
  m.doc() =
      "ActiveKV engine and vLLM attention-backend objects. KV-cache layout: [num_blocks, num_kv_heads, 2, "
      "block_size, head_size] over vLLM's LBHNC per-layer tensor.";
  activekv::py_glue::register_exceptions(m);
  m.attr("__version__") = activekv::engine_version();
  m.attr("torch_version") = activekv::engine_torch_version();
  m.attr("vllm_patch_version") = ACTIVEKV_VLLM_PATCH_VERSION;

  py::class_<PlanHandle>(m, "StepPlan", "One vLLM step's plan (the attention metadata every layer's forward gets).")
      .def_property_readonly("num_reqs", [](const PlanHandle& p) { return p.plan.num_reqs; })
      .def_property_readonly("num_actual_tokens", [](const PlanHandle& p) { return p.plan.num_actual_tokens; })
      .def_property_readonly("query_start_loc", [](const PlanHandle& p) { return p.plan.query_start_loc.clone(); },
                             "int32 [num_reqs + 1], a copy (the plan's own tensors cannot be changed after build).")
      .def_property_readonly("seq_lens", [](const PlanHandle& p) { return p.plan.seq_lens.clone(); },
                             "int32 [num_reqs], a copy.")
      .def_property_readonly("block_table", [](const PlanHandle& p) { return p.plan.block_table.clone(); },
                             "int32 [num_reqs, max_blocks], a copy.");

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine",
                                               "The ActiveKV engine: host tier + active pool + admission + tiled "
                                               "attention + telemetry, for num_layers layers.")
      .def(py::init([](int64_t num_layers, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                       int64_t block_size, at::ScalarType dtype, int64_t pool_blocks, int64_t tile_blocks,
                       at::Device device, const std::string& mode, int64_t budget_tokens, int64_t sink_blocks,
                       int64_t recent_blocks, const std::string& kernel, const std::string& transfer) {
             activekv::EngineConfig cfg;
             cfg.geometry = activekv::Geometry(num_layers, num_heads, num_kv_heads, head_size, block_size, dtype,
                                               tile_blocks);
             cfg.pool_blocks = pool_blocks;
             cfg.mode = activekv::parse_mode(mode);
             cfg.budget_tokens = budget_tokens;
             cfg.sink_blocks = sink_blocks;
             cfg.recent_blocks = recent_blocks;
             cfg.kernel = activekv::parse_kernel(kernel);
             cfg.transfer = activekv::parse_transfer(transfer);
             return std::make_shared<Engine>(cfg, device);
           }),
           py::arg("num_layers"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_size"),
           py::arg("block_size"), py::arg("dtype"), py::arg("pool_blocks"), py::arg("tile_blocks"),
           py::arg("device") = at::Device("cpu"), py::arg("mode") = "exact", py::arg("budget_tokens") = 2048,
           py::arg("sink_blocks") = 1, py::arg("recent_blocks") = 2, py::arg("kernel") = "native",
           py::arg("transfer") = "mapped",
           "mode 'exact' or 'compressed' (budget_tokens, sink_blocks, recent_blocks apply to compressed mode); kernel "
           "'native' (fast CPU kernel) or 'aten' (the bit-exact ATen tile path the reference mirrors). device: the "
           "pool's device; on CUDA each layer's kv_cache is device memory (resident) or pinned CPU memory (tiered), "
           "and transfer picks how a tiered engine admits blocks: 'mapped' (a device gather reading pinned host "
           "memory) or 'staged' (CPU gather into pinned staging, one host-to-device copy).")
      .def(
          "build",
          [](const std::shared_ptr<Engine>& e, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
             const at::Tensor& block_table, int64_t num_actual_tokens, std::optional<int64_t> num_reqs) {
            TORCH_CHECK_VALUE(seq_lens.dim() == 1, "seq_lens must be 1-D [num_reqs], got ", seq_lens.sizes());
            const int64_t n = num_reqs ? *num_reqs : seq_lens.size(0);
            PlanHandle h{e, {}};
            {
              py::gil_scoped_release release;
              h.plan = e->build(query_start_loc, seq_lens, block_table, n, num_actual_tokens);
            }
            return h;
          },
          py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_table"), py::arg("num_actual_tokens"),
          py::arg("num_reqs") = py::none(),
          "Plan a step from int32/int64 CPU tensors: query_start_loc [B + 1], seq_lens [B], block_table [B, W].")
      .def("update_kv", &Engine::update_kv, py::arg("layer"), py::arg("key"), py::arg("value"), py::arg("kv_cache"),
           py::arg("slot_mapping"), py::call_guard<py::gil_scoped_release>(),
           "Write key/value [T, KVH, D] into the layer's KV cache at slot_mapping [n <= T] (-1 = padding).")
      .def(
          "forward",
          [](const std::shared_ptr<Engine>& e, int64_t layer, const PlanHandle& plan, const at::Tensor& query,
             const at::Tensor& kv_cache, const at::Tensor& output, double scale) {
            TORCH_CHECK_VALUE(plan.engine == e, "plan was built by another ActiveKV engine");
            py::gil_scoped_release release;
            e->forward(layer, plan.plan, query, kv_cache, output, scale);
          },
          py::arg("layer"), py::arg("plan"), py::arg("query"), py::arg("kv_cache"), py::arg("output"),
          py::arg("scale"), "Attention for the planned step: query [T, H, D] -> output [T, H, D] (written in place).")
      .def("snapshot", [](Engine& e) { return activekv::py_glue::snapshot_to_dict(e.telemetry().snapshot()); },
           "This engine's counters, histograms and info.")
      .def("reset_telemetry", [](Engine& e) { e.telemetry().reset(); }, "Zero this engine's counters/histograms.")
      .def("layer_index", &Engine::layer_index, py::arg("name"), "Layer index of a vLLM layer name.")
      .def(
          "resident",
          [](Engine& e, int64_t layer) {
            std::vector<std::pair<int64_t, int64_t>> blocks;
            {
              py::gil_scoped_release release;
              blocks = e.resident(layer);
            }
            py::dict d;
            for (const auto& [block, slot] : blocks) d[py::int_(block)] = slot;
            return d;
          },
          py::arg("layer"), "{block id: pool slot} of the layer's resident blocks.")
      .def("pool", &Engine::pool, py::arg("layer"), py::call_guard<py::gil_scoped_release>(),
           "A copy of the layer's active pool [pool_blocks, num_kv_heads, 2, block_size, head_size].")
      .def("key_min", &Engine::key_min, py::arg("layer"), py::call_guard<py::gil_scoped_release>(),
           "A copy of the per-block key minimum [num_blocks, num_kv_heads, head_size] in the KV dtype; None before "
           "the layer's first KV update.")
      .def("key_max", &Engine::key_max, py::arg("layer"), py::call_guard<py::gil_scoped_release>(),
           "A copy of the per-block key maximum [num_blocks, num_kv_heads, head_size] in the KV dtype; None before "
           "the layer's first KV update.")
      .def(
          "selection",
          [](Engine& e, int64_t layer) {
            std::vector<std::pair<int64_t, at::Tensor>> rows;
            {
              py::gil_scoped_release release;
              rows = e.last_selection(layer);
            }
            py::dict d;
            for (const auto& [row, ids] : rows) d[py::int_(row)] = ids;
            return d;
          },
          py::arg("layer"),
          "Compressed mode, the layer's last forward: {request row: int64 [num_kv_heads, per_head] block ids each KV "
          "head attended} (copies); rows that ran exactly are absent.")
      .def_property_readonly("top_k", [](Engine& e) { return e.selection().top_k; },
                             "Blocks chosen per KV head by score (compressed mode).")
      .def_property_readonly("num_layers", [](Engine& e) { return e.geometry().num_layers; })
      .def_property_readonly("pool_blocks", [](Engine& e) { return e.config().pool_blocks; })
      .def_property_readonly("tile_blocks", [](Engine& e) { return e.geometry().tile_blocks; })
      .def_property_readonly("block_size", [](Engine& e) { return e.geometry().block_size; })
      .def_property_readonly("mode", [](Engine& e) { return std::string(activekv::mode_name(e.config().mode)); })
      .def_property_readonly("kernel",
                             [](Engine& e) { return std::string(activekv::kernel_name(e.config().kernel)); });

  py::class_<Builder>(m, "Builder", "vLLM AttentionMetadataBuilder delegate: creates the engine for a KV-cache group.")
      .def(py::init([](py::object kv_cache_spec, std::vector<std::string> layer_names, py::object vllm_config,
                       at::Device device) {
             require_patched_vllm();
             return Builder{make_builder_engine(kv_cache_spec, layer_names, vllm_config, device)};
           }),
           py::arg("kv_cache_spec"), py::arg("layer_names"), py::arg("vllm_config"), py::arg("device"))
      .def(
          "build",
          [](const Builder& b, int64_t common_prefix_len, py::object cm, bool fast_build) {
            TORCH_CHECK_TYPE(py::hasattr(cm, "causal"), "common_attn_metadata.causal is missing");
            py::object causal = cm.attr("causal");
            TORCH_CHECK_NOT_IMPLEMENTED(py::isinstance<py::bool_>(causal) && causal.cast<bool>(),
                                        "ActiveKV supports causal attention only (common_attn_metadata.causal must be "
                                        "True), got ", std::string(py::repr(causal)));
            const at::Tensor qsl = cpu_attr(cm, "query_start_loc_cpu", "query_start_loc");
            const char* owner = "common_attn_metadata";
            const auto seq_lens = attr_as<at::Tensor>(cm, owner, "seq_lens", "a tensor");
            const auto block_table = attr_as<at::Tensor>(cm, owner, "block_table_tensor", "a tensor");
            const auto num_reqs = attr_as<int64_t>(cm, owner, "num_reqs", "an int");
            const auto num_actual_tokens = attr_as<int64_t>(cm, owner, "num_actual_tokens", "an int");
            PlanHandle h{b.engine, {}};
            py::gil_scoped_release release;
            h.plan = b.engine->build(qsl, seq_lens, block_table, num_reqs, num_actual_tokens);
            return h;
          },
          py::arg("common_prefix_len"), py::arg("common_attn_metadata"), py::arg("fast_build") = false,
          "Plan a step from vLLM's CommonAttentionMetadata; returns the StepPlan vLLM passes to forward.")
      .def_property_readonly("engine", [](const Builder& b) { return b.engine; }, "The engine this builder created.");

  py::class_<Impl>(m, "Impl", "vLLM AttentionImpl delegate: KV update and forward for one attention layer.")
      .def(py::init(&make_impl), py::arg("num_heads"), py::arg("head_size"), py::arg("scale"),
           py::arg("num_kv_heads") = py::none(), py::arg("alibi_slopes") = py::none(),
           py::arg("sliding_window") = py::none(), py::arg("kv_cache_dtype") = "auto",
           py::arg("logits_soft_cap") = py::none(), py::arg("attn_type") = py::none(),
           py::arg("kv_sharing_target_layer_name") = py::none(), py::arg("sinks") = py::none())
      .def_readonly("num_heads", &Impl::num_heads)
      .def_readonly("head_size", &Impl::head_size)
      .def_readonly("scale", &Impl::scale)
      .def_readonly("num_kv_heads", &Impl::num_kv_heads)
      .def_readonly("kv_cache_dtype", &Impl::kv_cache_dtype)
      .def_readonly("attn_type", &Impl::attn_type)
      .def(
          "forward",
          [](const Impl& impl, py::object layer, const at::Tensor& query, py::object key, py::object value,
             const at::Tensor& kv_cache, py::object attn_metadata, const at::Tensor& output, py::object output_scale,
             py::object output_block_scale) {
            TORCH_CHECK_NOT_IMPLEMENTED(output_scale.is_none() && output_block_scale.is_none(),
                                        "ActiveKV does not support fused output quantization");
            const std::string name = layer_name(layer);
            // No metadata: vLLM's warm-up / profiling run, a no-op by the backend contract (cpu_attn.py:382-384
            // returns output untouched). In vLLM's default compiled mode it comes before initialize_kv_cache creates
            // any metadata builder (cpu_worker.py:204-206 runs profile_run first), so no engine may exist yet: the
            // forward is counted only on an engine this cache identifies, never required, never guessed.
            if (attn_metadata.is_none()) {
              if (auto engine = identified_by_cache(live_engines_for(name), name, kv_cache))
                engine->note_forward_skipped();
              return output;
            }
            TORCH_CHECK_TYPE(py::isinstance<PlanHandle>(attn_metadata),
                             "attn_metadata must be an activekv StepPlan (from the ActiveKV metadata builder), got ",
                             std::string(py::str(py::type::of(attn_metadata))));
            const auto& plan = attn_metadata.cast<const PlanHandle&>();
            const int64_t idx = plan.engine->layer_index(name);
            py::gil_scoped_release release;
            plan.engine->forward(idx, plan.plan, query, kv_cache, output, impl.scale);
            return output;
          },
          py::arg("layer"), py::arg("query"), py::arg("key"), py::arg("value"), py::arg("kv_cache"),
          py::arg("attn_metadata"), py::arg("output"), py::arg("output_scale") = py::none(),
          py::arg("output_block_scale") = py::none(),
          "query [T, H, D] attends over the layer's KV cache; writes and returns output [T, H, D].")
      .def(
          "do_kv_cache_update",
          [](const Impl&, py::object layer, const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
             const at::Tensor& slot_mapping) {
            auto engine = engine_for_layer(layer_name(layer), kv_cache);
            const int64_t idx = engine->layer_index(layer_name(layer));
            py::gil_scoped_release release;
            engine->update_kv(idx, key, value, kv_cache, slot_mapping);
          },
          py::arg("layer"), py::arg("key"), py::arg("value"), py::arg("kv_cache"), py::arg("slot_mapping"),
          "Write key/value [T, KVH, D] into the layer's KV cache at slot_mapping (-1 = padding).");

  m.def(
      "check_patch_series",
      [](const std::string& vllm_dir, std::optional<std::string> patch_dir) {
        const std::string dir = patch_dir ? *patch_dir : installed_patch_dir();
        SeriesVerdict v;
        {
          py::gil_scoped_release release;
          v = series_verdict(vllm_dir, dir, "this vLLM");
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
      "with this module, <activekv>/patches/vllm/v" ACTIVEKV_VLLM_PATCH_VERSION "). Returns {vllm_root, vllm_version, "
      "patch_dir, patches, state='applied'}. Raises RuntimeError naming what was expected, what was found (each "
      "patch: applied, not applied, or matching neither side) and the fix; also when the check cannot run (no vllm "
      "package there, no series, git missing). Runs `git apply --check`; changes nothing.");
  m.def(
      "verified_marker",
      [](const std::string& vllm_dir, std::optional<std::string> patch_dir) {
        namespace s = activekv::series;
        const std::string dir = patch_dir ? *patch_dir : installed_patch_dir();
        std::string marker, error;
        {
          py::gil_scoped_release release;
          try {
            marker = s::verified_marker(s::tree_root(vllm_dir), load_series(dir));
          } catch (const s::PatchError& e) {
            error = e.what();
          }
        }
        TORCH_CHECK(error.empty(), "cannot compute the ", s::kVerifiedVar, " value for ", vllm_dir, ": ", error);
        return marker;
      },
      py::arg("vllm_dir"), py::arg("patch_dir") = py::none(),
      "The ACTIVEKV_PATCH_VERIFIED value `activekv serve` / `run-batch` export after their patch series check passed "
      "on the vLLM tree at vllm_dir (a directory holding vllm/, or the vllm package directory; str) with the series in "
      "patch_dir (str; default: the series installed with this module), computed from the files as they are now by "
      "the launcher's own function (bindings/series/patch_series.h, verified_marker): no check runs, no git. Returns "
      "a str 'v1;vllm=" ACTIVEKV_VLLM_PATCH_VERSION ";state=fnv1a64:<16 hex digits>;tree=<root>;series=<series "
      "dir>' (real paths; state is the FNV-1a 64-bit digest of the series and of the tree's files it touches), or '' "
      "where a path cannot be written in that form (';' or a control character in it: the launcher exports no value "
      "then). Raises RuntimeError when vllm_dir holds no vllm package, patch_dir holds no series (or it lists a "
      "missing patch) or a file cannot be read; TypeError for arguments that are not str.");
  // vLLM's general plugin group (vllm/plugins/__init__.py, DEFAULT_PLUGINS_GROUP "vllm.general_plugins", entry point in
  // pyproject.toml): load_general_plugins() calls it once per vLLM process at start-up (vllm/v1/engine/core.py,
  // vllm/engine/arg_utils.py, vllm/v1/worker/worker_base.py), whichever attention backend is selected. On a vLLM the
  // series is not applied to, vLLM never imports ActiveKV and selecting ACTIVEKV fails with vLLM's own "Unknown
  // attention backend"; this puts ActiveKV's diagnosis and fix before it, as a warning (never an exception: a vLLM
  // that does not use ActiveKV must still start).
  m.def(
      "vllm_general_plugin",
      []() {
        const std::string problem = patched_vllm_problem();
        if (problem.empty()) return;
        const std::string end = problem.back() == '.' ? " " : ". ";
        const std::string msg = "ActiveKV is installed but " + problem + end +
                                "Until then vLLM does not know the ACTIVEKV attention backend (selecting it fails "
                                "with vLLM's 'Unknown attention backend'); other backends are not affected.";
        if (PyErr_WarnEx(PyExc_RuntimeWarning, msg.c_str(), 1) != 0) throw py::error_already_set();
      },
      "vLLM's general plugin (entry point group vllm.general_plugins), called once per vLLM process at start-up: a "
      "RuntimeWarning naming the problem and the fix when the vLLM this process imported does not carry this "
      "ActiveKV's patch series (the check the first Impl / Builder makes, shared with it); nothing otherwise. Never "
      "raises (unless warnings are made errors).");
  activekv::py_glue::define_host_tier(m, &live_engines_for);  // backend_host_tier.cpp
  m.def("name", []() { return std::string("ACTIVEKV"); }, "The backend name vLLM selects.");
  m.def("cpu_kernel_capability", &activekv::cpu_kernel_capability,
        "CPU capability of the fast kernel in use: 'avx512', 'avx2' or 'default' (ATEN_CPU_CAPABILITY caps it).");
  m.def("cpu_kernel_amx", &activekv::cpu_kernel_has_amx,
        "Whether the fast CPU kernel multiplies bfloat16 KV on AMX tiles (head size a multiple of 32, block size a "
        "multiple of 16): capability avx512, a processor with AMX-BF16, Linux granting the tile state, ACTIVEKV_CPU_AMX not '0'.");
  m.def("parallel_for_threads", &activekv::parallel_for_threads, py::arg("n"),
        py::call_guard<py::gil_scoped_release>(),
        "Distinct threads that ran n tasks through at::parallel_for in the engine library (1 if it was built without "
        "OpenMP, whatever torch.get_num_threads() says). Raises ValueError if n < 1.");
  m.def("supported_dtypes", &activekv::supported_dtypes, "Model dtypes the backend supports.");
  m.def("supported_kv_cache_dtypes", []() { return std::vector<std::string>{"auto"}; },
        "KV-cache dtypes the backend supports (no fp8).");
  m.def("supported_head_sizes", &activekv::supported_head_sizes, "Head sizes the backend supports.");
  m.def("supported_block_sizes", &activekv::supported_block_sizes, "KV-cache block sizes the backend supports.");
  m.def("supports_sliding_window", []() { return false; }, "Sliding-window attention: not supported.");
  m.def("supports_sink", []() { return false; }, "Attention sinks: not supported.");
  m.def("supports_non_causal", []() { return false; }, "Non-causal attention: not supported.");
  m.def("supports_kv_connector", []() { return false; }, "KV connectors: not supported (ActiveKV owns the layout).");
  m.def("supports_attn_type", [](const std::string& t) { return t == "decoder"; }, py::arg("attn_type"),
        "True for decoder attention only.");
}
