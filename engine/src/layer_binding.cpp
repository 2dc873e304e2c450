// The engines that serve an attention Impl's layer (layer_binding.h): binding at builder construction, and the choice
// among them by KV cache.
#include <activekv/check.h>
#include <activekv/layer_binding.h>

#include <algorithm>

namespace activekv {

namespace {

// Among the live engines serving one layer, the one this KV cache identifies: the engine whose layer is bound to this
// very tensor, else the one engine whose layer is still unbound; an empty ServedLayer when neither names exactly one.
ServedLayer identified_by_cache(const std::vector<ServedLayer>& served, const at::Tensor& kv_cache) {
  ServedLayer bound, unbound;
  int64_t n_bound = 0, n_unbound = 0;
  for (const auto& s : served) {
    const auto binding = s.engine->host_binding(s.layer, kv_cache);
    if (binding == Engine::HostBinding::kUnbound) {
      unbound = s;
      ++n_unbound;
    } else if (binding == Engine::HostBinding::kThis) {
      bound = s;
      ++n_bound;
    }
  }
  if (n_bound == 1) return bound;
  if (n_bound == 0 && n_unbound == 1) return unbound;
  return {};
}

}  // namespace

void LayerBindings::bind(const std::shared_ptr<Engine>& engine, const std::string& name) {
  const int64_t layer = engine->layer_index(name);
  bindings_.erase(std::remove_if(bindings_.begin(), bindings_.end(),
                                 [](const Binding& b) { return b.engine.expired(); }),
                  bindings_.end());
  bindings_.push_back(Binding{engine, layer, name});
}

std::vector<ServedLayer> LayerBindings::live(const std::string& name) const {
  std::vector<ServedLayer> out;
  for (const auto& b : bindings_)
    if (b.name == name)
      if (auto e = b.engine.lock()) out.push_back(ServedLayer{std::move(e), b.layer});
  return out;
}

ServedLayer LayerBindings::for_kv_update(const std::string& name, const at::Tensor& kv_cache) const {
  auto served = live(name);
  AKV_CHECK_VALUE(!served.empty(), "no ActiveKV engine serves layer '", name,
                  "': the ActiveKV metadata builder for its KV-cache group was not created or was released");
  if (served.size() == 1) return served.front();
  auto chosen = identified_by_cache(served, kv_cache);
  TORCH_CHECK(chosen.engine, "layer '", name, "' is served by ", served.size(),
              " live ActiveKV engines and this KV cache does not identify one of them");
  return chosen;
}

ServedLayer LayerBindings::for_skipped_forward(const std::string& name, const at::Tensor& kv_cache) const {
  return identified_by_cache(live(name), kv_cache);
}

}  // namespace activekv
