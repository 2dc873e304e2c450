#pragma once
/// @file layer_binding.h
/// @brief Which engine serves one vLLM attention layer's KV update: the bindings a metadata builder makes, at its
///        construction, on the attention Impl of each layer it serves (no process-wide lookup by layer name).
///
/// vLLM hands the KV update (do_kv_cache_update) the layer, the new K/V, the layer's KV cache and the slot mapping,
/// but no metadata: the Impl therefore holds, per builder that serves its layer, the builder's engine (weakly: a
/// released builder's engine drops out) and the layer's index there. One binding is the rule; several arise when
/// several live builders serve one Impl's layer name (vLLM's micro-batching makes one builder per micro-batch). The
/// KV cache then tells them apart: the engine serving this cache is the one whose layer is bound to this very tensor
/// (bound at its first KV update); a cache no engine has bound yet belongs to the one engine whose layer is still
/// unbound. Anything else is ambiguous and an error, never a guess.
#include <activekv/engine.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace activekv {

/// An engine and the index of a layer in it.
struct ServedLayer {
  std::shared_ptr<Engine> engine;
  int64_t layer = -1;
};

/// The engines that serve one attention Impl's layer. Not thread-safe: the binding calls it with the GIL held.
class LayerBindings {
 public:
  /// Bind `engine`'s layer `name` (its index is looked up once, here). Drops bindings whose engine is gone.
  /// @throws c10::ValueError when `engine` does not serve `name`.
  void bind(const std::shared_ptr<Engine>& engine, const std::string& name);
  /// The engine and layer index that serve a KV update of layer `name` on `kv_cache`.
  /// @throws c10::ValueError when no live engine serves `name` ("no ActiveKV engine serves layer ..."); c10::Error
  ///         when several do and `kv_cache` identifies none of them.
  ServedLayer for_kv_update(const std::string& name, const at::Tensor& kv_cache) const;
  /// The engine a forward without metadata (vLLM's warm-up) on `kv_cache` belongs to, if the cache identifies one
  /// among the live engines serving `name`; an empty ServedLayer otherwise (no builder yet: nothing to count).
  ServedLayer for_skipped_forward(const std::string& name, const at::Tensor& kv_cache) const;

 private:
  struct Binding {
    std::weak_ptr<Engine> engine;
    int64_t layer;
    std::string name;
  };
  std::vector<ServedLayer> live(const std::string& name) const;
  std::vector<Binding> bindings_;
};

}  // namespace activekv
