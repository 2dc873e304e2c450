// Geometry (geometry.h): the supported shapes, the geometry's checks and arithmetic (slots, blocks, bytes, cache
// shapes), viewing vLLM's per-layer KV cache in ActiveKV's block layout, CPU pools against physical memory.
#include <activekv/check.h>
#include <activekv/geometry.h>
#include <unistd.h>

#include <algorithm>
#include <sstream>

namespace activekv {

std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  os << "]";
  return os.str();
}

std::vector<at::ScalarType> supported_dtypes() { return {at::kFloat, at::kBFloat16, at::kHalf}; }

std::vector<int64_t> supported_head_sizes() { return {32, 64, 80, 96, 112, 128, 160, 192, 224, 256}; }

std::vector<int64_t> supported_block_sizes() { return {16, 32, 64, 128}; }

Geometry::Geometry(int64_t num_layers_, int64_t num_heads_, int64_t num_kv_heads_, int64_t head_size_,
                   int64_t block_size_, at::ScalarType dtype_, int64_t tile_blocks_)
    : num_layers(num_layers_),
      num_heads(num_heads_),
      num_kv_heads(num_kv_heads_),
      head_size(head_size_),
      block_size(block_size_),
      dtype(dtype_),
      tile_blocks(tile_blocks_) {
  AKV_CHECK_VALUE(num_layers > 0, "num_layers must be > 0, got ", num_layers);
  AKV_CHECK_VALUE(num_heads > 0, "num_heads must be > 0, got ", num_heads);
  AKV_CHECK_VALUE(num_kv_heads > 0, "num_kv_heads must be > 0, got ", num_kv_heads);
  AKV_CHECK_VALUE(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads (GQA), got ",
                  num_heads, " and ", num_kv_heads);
  AKV_CHECK_VALUE(head_size > 0, "head_size must be > 0, got ", head_size);
  AKV_CHECK_VALUE(block_size > 0, "block_size must be > 0, got ", block_size);
  AKV_CHECK_VALUE(tile_blocks > 0, "tile_blocks must be > 0, got ", tile_blocks);
  int64_t elems = 0;
  // Every product checked, 2 * block_size included (block_size >= 2^62 overflowed there: undefined behaviour).
  const bool overflow = __builtin_mul_overflow(num_kv_heads, block_size, &elems) ||
                        __builtin_mul_overflow(elems, int64_t{2}, &elems) ||
                        __builtin_mul_overflow(elems, head_size, &elems) || elems > (int64_t{1} << 40) ||
                        __builtin_mul_overflow(tile_blocks, block_size, &elems);
  AKV_CHECK_VALUE(!overflow, "num_kv_heads * 2 * block_size * head_size must stay below 2^40 elements per block and ",
                  "tile_blocks * block_size within int64, got num_kv_heads ", num_kv_heads, ", block_size ", block_size,
                  ", head_size ", head_size, ", tile_blocks ", tile_blocks);
  const auto dts = supported_dtypes();
  AKV_CHECK_TYPE(std::find(dts.begin(), dts.end(), dtype) != dts.end(),
                 "dtype must be float32, bfloat16 or float16, got ", dtype);
}

std::pair<int64_t, int64_t> Geometry::slot_to_block(int64_t slot) const {
  AKV_CHECK_INDEX(slot >= 0, "slot must be >= 0, got ", slot);
  return {slot / block_size, slot % block_size};
}

int64_t Geometry::blocks_for(int64_t length) const {
  AKV_CHECK_VALUE(length >= 0, "length must be >= 0, got ", length);
  return length / block_size + (length % block_size != 0);
}

int64_t Geometry::bytes_per_block() const {
  return elements_per_block() * static_cast<int64_t>(c10::elementSize(dtype));
}

std::vector<int64_t> Geometry::kv_cache_shape(int64_t num_blocks) const {
  AKV_CHECK_VALUE(num_blocks >= 0, "num_blocks must be >= 0, got ", num_blocks);
  return {num_blocks, num_kv_heads, 2, block_size, head_size};
}

std::vector<int64_t> Geometry::vllm_cache_shape(int64_t num_blocks) const {
  AKV_CHECK_VALUE(num_blocks >= 0, "num_blocks must be >= 0, got ", num_blocks);
  return {num_blocks, num_kv_heads, block_size, 2 * head_size};
}

at::Tensor as_block_layout(const Geometry& g, const at::Tensor& kv_cache, const char* name) {
  AKV_CHECK_TYPE(kv_cache.defined(), name, " must be a tensor, got None");
  AKV_CHECK_TYPE(kv_cache.scalar_type() == g.dtype, name, " must have dtype ", g.dtype, ", got ",
                 kv_cache.scalar_type());
  AKV_CHECK_VALUE(kv_cache.dim() == 4 || kv_cache.dim() == 5, name,
                  " must be [num_blocks, num_kv_heads, 2, block_size, head_size] or vLLM's [num_blocks, "
                  "num_kv_heads, block_size, 2 * head_size], got ",
                  shape_str(kv_cache.sizes()));
  const int64_t nb = kv_cache.size(0);
  const auto want = kv_cache.dim() == 5 ? g.kv_cache_shape(nb) : g.vllm_cache_shape(nb);
  AKV_CHECK_VALUE(kv_cache.sizes().vec() == want, name, " must be ", shape_str(want), ", got ",
                  shape_str(kv_cache.sizes()));
  AKV_CHECK_VALUE(kv_cache.is_contiguous(), name, " must be contiguous (ActiveKV reinterprets each block's bytes), ",
                  "got strides ", shape_str(kv_cache.strides()));
  check_in_storage(kv_cache, name);
  return kv_cache.view(g.kv_cache_shape(nb));
}

void check_pools_fit_memory(const Geometry& g, int64_t pool_blocks, at::Device device, const std::string& label) {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (!device.is_cpu() || pool_blocks <= 0 || pages <= 0 || page <= 0) return;
  const auto gib = [](long double bytes) { return static_cast<double>(bytes / (1024.0L * 1024.0L * 1024.0L)); };
  const long double need = static_cast<long double>(pool_blocks) * g.bytes_per_block() * g.num_layers;
  const long double have = static_cast<long double>(pages) * page;
  AKV_CHECK_VALUE(need <= have, label, " = ", pool_blocks, " needs ", gib(need), " GiB of pools (", g.num_layers,
                  " layers, ", g.bytes_per_block(), " bytes per block), more than this machine's memory (", gib(have),
                  " GiB)");
}

}  // namespace activekv
