// Key-value state (kv_state.h): the layers' pools, page tables and key metadata, host-tier binding, and the KV update.
#include <activekv/check.h>
#include <activekv/cuda_kernel.h>
#include <activekv/host_tier.h>
#include <activekv/kv_state.h>
#include <activekv/transfer.h>

#include <ATen/Parallel.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <unordered_set>

namespace activekv {

namespace {
constexpr float kInf = std::numeric_limits<float>::infinity();
// Tokens per thread of the CPU write at least (a prefill chunk's tokens split over the threads, a decode step's not).
constexpr int64_t kWriteTokensPerThread = 256;

// The CPU write of KVState::write as plain loops (no ATen op per call): for each token i, K and V of every KV head to
// the host tier at (blk[i], off[i]) and, where the block is resident (slot[i] >= 0), to its pool copy; then the key
// min/max (in the KV dtype: a key's own value, so exact) of every written block, reset first where a token lands at
// offset 0. The same values as the ATen ops of the other devices: copies are exact, and min/max propagate NaN as
// scatter_reduce's amin/amax do (of -0 and +0 the first written stays; ATen leaves that tie, and a NaN's payload,
// unspecified). key/value [N, KVH, D] and host [num_blocks, KVH, 2, bs, D] of any strides; pool and key_min/max
// contiguous; key_min/max undefined where the state keeps no key metadata.
template <typename T>
void write_cpu(const at::Tensor& host, at::Tensor& pool, at::Tensor& key_min, at::Tensor& key_max,
               const at::Tensor& key, const at::Tensor& value, const std::vector<int64_t>& tok,
               const std::vector<int64_t>& blk, const std::vector<int64_t>& off, const std::vector<int64_t>& slot,
               const std::vector<int64_t>& reset) {
  const int64_t kvh = host.size(1), bs = host.size(3), d = host.size(4);
  T* h = host.data_ptr<T>();
  T* p = pool.data_ptr<T>();
  T* mn = key_min.defined() ? key_min.data_ptr<T>() : nullptr;
  T* mx = key_max.defined() ? key_max.data_ptr<T>() : nullptr;
  const auto hs = host.strides();
  const T* const src_base[2] = {key.data_ptr<T>(), value.data_ptr<T>()};
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), ks2 = key.stride(2);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1), vs2 = value.stride(2);
  if (mn != nullptr) {
    for (const int64_t b : reset) {
      std::fill(mn + b * kvh * d, mn + (b + 1) * kvh * d, static_cast<T>(kInf));
      std::fill(mx + b * kvh * d, mx + (b + 1) * kvh * d, static_cast<T>(-kInf));
    }
  }
  // Copies: every token to its own slots, so the tokens split over the threads (a decode step's few stay inline).
  const int64_t nt = static_cast<int64_t>(tok.size());
  at::parallel_for(0, nt, kWriteTokensPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t hh = 0; hh < kvh; ++hh) {
        for (int kv = 0; kv < 2; ++kv) {
          const T* src = src_base[kv] + tok[i] * (kv == 0 ? ks0 : vs0) + hh * (kv == 0 ? ks1 : vs1);
          const int64_t ss = kv == 0 ? ks2 : vs2;
          T* dst = h + blk[i] * hs[0] + hh * hs[1] + kv * hs[2] + off[i] * hs[3];
          T* pd = slot[i] >= 0 ? p + (((slot[i] * kvh + hh) * 2 + kv) * bs + off[i]) * d : nullptr;
          if (ss == 1 && hs[4] == 1) {
            std::copy(src, src + d, dst);
            if (pd != nullptr) std::copy(src, src + d, pd);
          } else {
            for (int64_t j = 0; j < d; ++j) dst[j * hs[4]] = src[j * ss];
            if (pd != nullptr)
              for (int64_t j = 0; j < d; ++j) pd[j] = src[j * ss];
          }
        }
      }
    }
  });
  if (mn == nullptr) return;
  // Key min/max: tokens of one block update the same values, so the KV heads split over the threads and each head's
  // tokens go in order.
  at::parallel_for(0, kvh, nt >= kWriteTokensPerThread ? 1 : kvh, [&](int64_t h0, int64_t h1) {
    for (int64_t hh = h0; hh < h1; ++hh) {
      for (int64_t i = 0; i < nt; ++i) {
        const T* k = src_base[0] + tok[i] * ks0 + hh * ks1;
        T* bmn = mn + (blk[i] * kvh + hh) * d;
        T* bmx = mx + (blk[i] * kvh + hh) * d;
        for (int64_t j = 0; j < d; ++j) {
          const T kj = k[j * ks2];
          const float x = static_cast<float>(kj), lo = static_cast<float>(bmn[j]), hi = static_cast<float>(bmx[j]);
          if ((std::isnan(x) || x < lo) && !std::isnan(lo)) bmn[j] = kj;
          if ((std::isnan(x) || x > hi) && !std::isnan(hi)) bmx[j] = kj;
        }
      }
    }
  });
}
}  // namespace

void reset_page_table(LayerState& layer) {
  const auto pool = static_cast<int64_t>(layer.block_of_slot.size());
  std::fill(layer.slot_of_block.begin(), layer.slot_of_block.end(), -1);
  std::fill(layer.block_of_slot.begin(), layer.block_of_slot.end(), -1);
  layer.last_use.assign(pool, 0);
  layer.pins.assign(pool, 0);
  layer.lru_prev.assign(pool, -1);
  layer.lru_next.assign(pool, -1);
  layer.lru_head = layer.lru_tail = -1;
  layer.next_free = 0;
  layer.pinned_slots = 0;
  layer.page_stale = true;
  layer.page_changed.clear();
}

KVState::KVState(const Geometry& g, int64_t pool_blocks, at::Device device, bool key_metadata)
    : g_(g), pool_blocks_(pool_blocks), device_(device), key_metadata_(key_metadata) {
  AKV_CHECK_VALUE(pool_blocks >= 0, "pool_blocks must be >= 0 (0: no pool, for placement in place), got ",
                  pool_blocks);
  check_pools_fit_memory(g, pool_blocks, device, "pool_blocks");
  layers_.resize(g.num_layers);
  int64_t bytes = 0;
  AKV_CHECK_VALUE(!__builtin_mul_overflow(pool_blocks, g.bytes_per_block(), &bytes), "pool_blocks (", pool_blocks,
                  ") x ", g.bytes_per_block(), " bytes per block overflows");
  for (auto& l : layers_) {
    try {
      l.pool = at::zeros(g.kv_cache_shape(pool_blocks), at::TensorOptions().dtype(g.dtype).device(device));
    } catch (const c10::Error& e) {
      AKV_CHECK_VALUE(false, "the active pool of pool_blocks = ", pool_blocks, " (", bytes,
                      " bytes per layer) could not be allocated on ", device, ": ", e.what_without_backtrace());
    }
    l.block_of_slot.assign(pool_blocks, -1);
    reset_page_table(l);
  }
}

LayerState& KVState::layer(int64_t index) {
  AKV_CHECK_INDEX(index >= 0 && index < g_.num_layers, "layer must be in [0, ", g_.num_layers, "), got ", index);
  return layers_[index];
}

const LayerState& KVState::layer(int64_t index) const {
  AKV_CHECK_INDEX(index >= 0 && index < g_.num_layers, "layer must be in [0, ", g_.num_layers, "), got ", index);
  return layers_[index];
}

int64_t KVState::key_metadata_bytes() const {
  int64_t bytes = 0;
  for (const auto& l : layers_)
    if (l.key_min.defined()) bytes += static_cast<int64_t>(l.key_min.nbytes() + l.key_max.nbytes());
  return bytes;
}

void KVState::reset_layer(int64_t index) {
  reset_page_table(layer(index));
}

const at::Tensor& KVState::device_page(int64_t index) {
  auto& l = layer(index);
  const auto pinned = at::TensorOptions().dtype(at::kInt).pinned_memory(true);
  if (!l.page_dev.defined() || l.page_dev.size(0) != l.host_blocks) {
    l.page_dev = at::empty({l.host_blocks}, at::TensorOptions().dtype(at::kInt).device(device_));
    l.page_stale = true;
  }
  if (l.page_stale) {
    auto host = at::empty({l.host_blocks}, pinned);
    std::copy(l.slot_of_block.begin(), l.slot_of_block.end(), host.data_ptr<int32_t>());
    l.page_dev.copy_(host, /*non_blocking=*/true);
  } else if (!l.page_changed.empty()) {
    const auto n = static_cast<int64_t>(l.page_changed.size());
    auto host = at::empty({2, n}, pinned);
    int32_t* ids = host.data_ptr<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      ids[i] = static_cast<int32_t>(l.page_changed[i]);
      ids[n + i] = static_cast<int32_t>(l.slot_of_block[l.page_changed[i]]);  // the slot now: repeats agree
    }
    auto dev = host.to(device_, /*non_blocking=*/true);
    l.page_dev.index_put_({dev[0].to(at::kLong)}, dev[1]);
  }
  l.page_stale = false;
  l.page_changed.clear();
  return l.page_dev;
}

at::Tensor KVState::host_view(const at::Tensor& kv_cache) const {
  auto host = as_block_layout(g_, kv_cache, "kv_cache");
  if (device_.is_cuda() && host.is_cpu()) {
    // Tiered: the host tier in pinned CPU memory, the pool on the device. Pageable memory would make every
    // admission a synchronous staged copy through the driver.
    AKV_CHECK_VALUE(host.is_pinned(), "kv_cache on cpu must be in pinned memory when the pool is on ", device_,
                    " (allocate it with torch.empty(..., pin_memory=True)), got pageable memory");
    return host;
  }
  AKV_CHECK_VALUE(host.device() == device_, "kv_cache must be on ", device_, " (the engine's device)",
                  device_.is_cuda() ? " or in pinned CPU memory" : "", ", got ", host.device());
  return host;
}

void KVState::check_bindable(int64_t index, const at::Tensor& host) const {
  const auto& bound = layer(index).host;  // index check
  check_in_storage(host, "kv_cache");
  // The view bound already: nothing can overlap it that was not refused when it or the other layer was bound.
  if (bound.defined() && bound.data_ptr() == host.data_ptr() && bound.sizes() == host.sizes() &&
      bound.strides() == host.strides() && bound.storage().is_alias_of(host.storage()))
    return;
  for (int64_t i = 0; i < g_.num_layers; ++i) {
    if (i == index || !layers_[i].host.defined()) continue;
    // Each layer keeps its own pool copies and key metadata of its host tier: a second layer on the same memory
    // would serve stale copies after the first layer's writes.
    check_no_overlap(host, c10::str("layer ", index, "'s kv_cache").c_str(), layers_[i].host,
                     c10::str("layer ", i, "'s bound kv_cache").c_str());
  }
}

void KVState::bind_host(int64_t index, const at::Tensor& host, Telemetry& t) {
  check_bindable(index, host);
  auto& l = layer(index);
  const int64_t nb = host.size(0);
  if (l.host.defined() && l.host.data_ptr() == host.data_ptr() && l.host_blocks == nb) return;
  if (l.host.defined()) t.add(Counter::kHostRebinds);
  l.host = host;
  l.host_blocks = nb;
  l.slot_of_block.assign(nb, -1);
  reset_layer(index);
  if (!key_metadata_) return;
  auto opts = at::TensorOptions().dtype(g_.dtype).device(device_);  // the KV dtype: every min/max is a key's value
  l.key_min = at::full({nb, g_.num_kv_heads, g_.head_size}, kInf, opts);
  l.key_max = at::full({nb, g_.num_kv_heads, g_.head_size}, -kInf, opts);
  t.set_gauge(Gauge::kKeyMetadataBytes, key_metadata_bytes());
}

bool CheckedSlots::covers(const at::Tensor& slot_mapping) const {
  if (!tensor.defined() || !slot_mapping.defined() || slot_mapping.dim() != 1) return false;
  if (slot_mapping.data_ptr() != tensor.data_ptr() || slot_mapping.scalar_type() != tensor.scalar_type() ||
      slot_mapping.device() != tensor.device() || slot_mapping.size(0) > static_cast<int64_t>(values.size()) ||
      (slot_mapping.size(0) > 1 && slot_mapping.stride(0) != tensor.stride(0)))
    return false;
  // Views share their base's version counter: an in-place ATen op on any of them since the check shows here.
  if (slot_mapping.is_inference() != tensor.is_inference()) return false;
  return slot_mapping.is_inference() || static_cast<int64_t>(slot_mapping._version()) == version;
}

CheckedSlots check_step_slots(const at::Tensor& slot_mapping) {
  CheckedSlots c;
  if (!slot_mapping.defined() || !slot_mapping.is_cuda() || slot_mapping.dim() != 1 ||
      (slot_mapping.scalar_type() != at::kLong && slot_mapping.scalar_type() != at::kInt))
    return c;
  const auto version = slot_mapping.is_inference() ? int64_t{-1} : static_cast<int64_t>(slot_mapping._version());
  const auto cpu = slot_mapping.to(at::kCPU, at::kLong).contiguous();
  const int64_t* v = cpu.data_ptr<int64_t>();
  const int64_t n = cpu.size(0);
  std::unordered_set<int64_t> seen;
  seen.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    if (v[i] < -1 || (v[i] >= 0 && !seen.insert(v[i]).second)) return c;
  c.tensor = slot_mapping;
  c.version = version;
  c.values.assign(v, v + n);
  return c;
}

bool KVState::take_write_error() {
  if (!write_error_.defined()) return false;
  auto* flag = static_cast<volatile int32_t*>(write_error_.data_ptr());
  if (*flag == 0) return false;
  *flag = 0;
  return true;
}

void KVState::write(int64_t index, const at::Tensor& host, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& slot_mapping, Telemetry& t, const CheckedSlots* checked) {
  layer(index);  // index check
  const int64_t kvh = g_.num_kv_heads, d = g_.head_size, bs = g_.block_size;
  for (const auto& [name, x] : {std::pair<const char*, const at::Tensor*>{"key", &key}, {"value", &value}}) {
    AKV_CHECK_TYPE(x->defined(), name, " must be a tensor, got None");
    AKV_CHECK_TYPE(x->scalar_type() == g_.dtype, name, " must have dtype ", g_.dtype, ", got ", x->scalar_type());
    AKV_CHECK_VALUE(x->dim() == 3 && x->size(1) == kvh && x->size(2) == d, name, " must be [num_tokens, ", kvh, ", ",
                    d, "], got ", shape_str(x->sizes()));
    AKV_CHECK_VALUE(x->device() == device_, name, " must be on ", device_, ", got ", x->device());
    check_has_data(*x, name);
    check_no_overlap(*x, name, host, "kv_cache");  // read while kv_cache is written
  }
  // The host tier is written in place and key/value are read outside autograd: plain data only, checked here so
  // every entry point that writes (Engine::update_kv, the _kv_state binding) rejects the same inputs.
  check_writable(host, "kv_cache");
  AKV_CHECK_VALUE(!key.requires_grad() && !value.requires_grad(),
                  "key and value must not require grad (ActiveKV computes without autograd)");
  AKV_CHECK_VALUE(key.size(0) == value.size(0), "key and value must have the same number of tokens, got ",
                  key.size(0), " and ", value.size(0));
  AKV_CHECK_TYPE(slot_mapping.defined() && (slot_mapping.scalar_type() == at::kLong ||
                                            slot_mapping.scalar_type() == at::kInt),
                 "slot_mapping must be an int64 or int32 tensor, got ",
                 slot_mapping.defined() ? c10::toString(slot_mapping.scalar_type()) : "None");
  check_has_data(slot_mapping, "slot_mapping");
  check_no_overlap(slot_mapping, "slot_mapping", host, "kv_cache");
  AKV_CHECK_VALUE(slot_mapping.dim() == 1, "slot_mapping must be 1-D [num_tokens], got ",
                  shape_str(slot_mapping.sizes()));
  const int64_t n = slot_mapping.size(0);
  AKV_CHECK_VALUE(n <= key.size(0), "slot_mapping has ", n, " entries but key holds only ", key.size(0), " tokens");

  // Validate every slot before writing anything: a bad entry leaves both tiers as they were. The CUDA kernel reads the
  // slots on the device; their host copy is the step's checked one where it covers this tensor (no synchronisation),
  // else a copy (which waits for the stream on a device slot mapping).
  const bool kernel = device_.is_cuda() && cuda_kv_write() != nullptr;
  const bool trusted = kernel && checked != nullptr && checked->covers(slot_mapping);
  at::Tensor sm;
  const int64_t* sp = nullptr;
  if (trusted) {
    sp = checked->values.data();
  } else {
    sm = slot_mapping.to(at::kCPU, at::kLong).contiguous();
    sp = sm.data_ptr<int64_t>();
  }
  const int64_t num_slots = host.size(0) * bs;
  std::vector<int64_t> tok, blk, off, reset;
  std::unordered_set<int64_t> seen;
  int64_t padding = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = sp[i];
    if (s == -1) {  // vLLM's PAD_SLOT_ID
      ++padding;
      continue;
    }
    AKV_CHECK_INDEX(s >= 0 && s < num_slots, "slot_mapping[", i, "] must be -1 (padding) or in [0, ", num_slots,
                    "), got ", s);
    // Two tokens into one slot would make the write order (and so the bytes) unspecified. (A checked slot mapping
    // has no repeat.)
    AKV_CHECK_VALUE(trusted || seen.insert(s).second, "slot_mapping[", i, "] = ", s, " repeats an earlier slot");
    tok.push_back(i);
    blk.push_back(s / bs);
    off.push_back(s % bs);
    if (s % bs == 0) reset.push_back(s / bs);
  }
  check_bindable(index, host);
  // Every check passed: bind (possibly resetting a reallocated layer) and write.
  bind_host(index, host, t);
  auto& l = layer(index);
  t.add(Counter::kPaddingSlots, padding);
  if (tok.empty()) return;

  const int64_t nt = static_cast<int64_t>(tok.size());
  if (device_.is_cpu() && host.is_cpu()) {
    std::vector<int64_t> slot(nt);
    int64_t through = 0;
    for (int64_t i = 0; i < nt; ++i) through += (slot[i] = l.slot_of_block[blk[i]]) >= 0 ? 1 : 0;
    const auto write = [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      write_cpu<T>(host, l.pool, l.key_min, l.key_max, key, value, tok, blk, off, slot, reset);
    };
    switch (g_.dtype) {
      case at::kFloat: write(static_cast<float*>(nullptr)); break;
      case at::kBFloat16: write(static_cast<at::BFloat16*>(nullptr)); break;
      case at::kHalf: write(static_cast<at::Half*>(nullptr)); break;
      default: AKV_CHECK_TYPE(false, "KV dtype must be float32, bfloat16 or float16, got ", g_.dtype);
    }
    t.add(Counter::kTokensWritten, nt);
    if (through > 0) t.add(Counter::kWriteThroughTokens, through);
    return;
  }
  if (kernel) {
    // Two launches on the current stream, after the compute that produced key and value: the host tier (through its
    // device mapping when it is pinned host memory), the pool copies of resident blocks (found in the page table on
    // the device, brought up to date first) and the key metadata.
    int64_t through = 0;
    for (const int64_t b : blk) through += l.slot_of_block[b] >= 0 ? 1 : 0;
    if (!write_error_.defined()) write_error_ = pinned_host_zeros(sizeof(int32_t));
    CudaKvWriteArgs a;
    a.host = host;
    a.pool = l.pool;
    if (through > 0) a.page = device_page(index);
    a.key_min = l.key_min;
    a.key_max = l.key_max;
    a.key = key;
    a.value = value;
    a.slot_mapping = slot_mapping.device() == device_ ? slot_mapping
                                                      : sm.pin_memory().to(device_, /*non_blocking=*/true);
    a.error = static_cast<int32_t*>(write_error_.data_ptr());
    cuda_kv_write()(a);
    t.add(Counter::kTokensWritten, nt);
    if (host.device() != device_) t.add(Counter::kBytesD2H, 2 * nt * kvh * d * static_cast<int64_t>(key.element_size()));
    if (through > 0) t.add(Counter::kWriteThroughTokens, through);
    return;
  }
  auto blk_t = index_tensor(blk, device_);
  auto off_t = index_tensor(off, device_);
  using at::indexing::Slice;
  auto k = key.index_select(0, index_tensor(tok, device_));    // [N, KVH, D]
  auto v = value.index_select(0, index_tensor(tok, device_));  // [N, KVH, D]
  if (host.device() == device_) {
    host.select(2, 0).index_put_({blk_t, Slice(), off_t}, k);
    host.select(2, 1).index_put_({blk_t, Slice(), off_t}, v);
  } else {
    // Tiered: a blocking device-to-host copy of the new tokens, ordered after the compute that produced them on
    // the current stream (the store can never race the kernel that writes the KV), then a CPU scatter.
    auto hb = index_tensor(blk, host.device()), ho = index_tensor(off, host.device());
    host.select(2, 0).index_put_({hb, Slice(), ho}, k.to(host.device()));
    host.select(2, 1).index_put_({hb, Slice(), ho}, v.to(host.device()));
    t.add(Counter::kBytesD2H, 2 * k.numel() * static_cast<int64_t>(k.element_size()));
  }
  t.add(Counter::kTokensWritten, nt);

  // Write-through: a resident copy of a written block gets the same tokens, so the pool never serves stale KV.
  std::vector<int64_t> wt_pos, wt_slot, wt_off;
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t s = l.slot_of_block[blk[i]];
    if (s >= 0) {
      wt_pos.push_back(i);
      wt_slot.push_back(s);
      wt_off.push_back(off[i]);
    }
  }
  if (!wt_pos.empty()) {
    auto pos = index_tensor(wt_pos, device_);
    auto slot_t = index_tensor(wt_slot, device_);
    auto woff_t = index_tensor(wt_off, device_);
    l.pool.select(2, 0).index_put_({slot_t, Slice(), woff_t}, k.index_select(0, pos));
    l.pool.select(2, 1).index_put_({slot_t, Slice(), woff_t}, v.index_select(0, pos));
    t.add(Counter::kWriteThroughTokens, static_cast<int64_t>(wt_pos.size()));
  }

  // Per-block key metadata [num_blocks, KVH, D]: a write at offset 0 starts a fresh fill of the block.
  if (!key_metadata_) return;
  if (!reset.empty()) {
    auto reset_t = index_tensor(reset, device_);
    l.key_min.index_fill_(0, reset_t, kInf);
    l.key_max.index_fill_(0, reset_t, -kInf);
  }
  auto kd = k.reshape({nt, kvh * d});  // in the KV dtype, as the metadata
  auto scatter_index = blk_t.unsqueeze(1).expand({nt, kvh * d});
  l.key_min.view({l.host_blocks, kvh * d}).scatter_reduce_(0, scatter_index, kd, "amin", true);
  l.key_max.view({l.host_blocks, kvh * d}).scatter_reduce_(0, scatter_index, kd, "amax", true);
}

}  // namespace activekv
