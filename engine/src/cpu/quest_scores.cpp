// Compressed mode's Quest scorer on the CPU (cpu_kernel.h QuestArgs): the bound of a decode row's candidate blocks,
// read in place from the layer's key metadata. Compiled once per CPU capability.
#include "kernel_primitives.h"

namespace activekv::cpu_kernel {
namespace CPU_CAPABILITY {

namespace {
// The unreduced bounds of N query heads of a KV head's group for one block over the head size's first dv values (a
// multiple of kW): out[u] = relu(q_u) * max + min(q_u, 0) * min, lane by lane. The N heads share each load of the
// block's min and max; each head sums its positive and negative parts in two vector accumulators (2N independent
// chains, instead of one chain of 2 * dv / kW dependent fused multiply-adds per head), added at the end. q rows have
// stride d.
template <int N, typename M>
inline void group_vectors(const float* qp, const float* qn, const M* mn, const M* mx, int64_t d, int64_t dv,
                          Vec* out) {
  Vec sp[N], sn[N];
  for (int u = 0; u < N; ++u) sp[u] = sn[u] = Vec(0.f);
  for (int64_t j = 0; j < dv; j += kW) {
    const Vec vmx = load_float(mx + j), vmn = load_float(mn + j);
    for (int u = 0; u < N; ++u) {
      sp[u] = at::vec::fmadd(Vec::loadu(qp + u * d + j), vmx, sp[u]);
      sn[u] = at::vec::fmadd(Vec::loadu(qn + u * d + j), vmn, sn[u]);
    }
  }
  for (int u = 0; u < N; ++u) out[u] = sp[u] + sn[u];
}

}  // namespace

namespace {
template <typename M>
void quest_scores_as(const QuestArgs& a, int64_t begin, int64_t end) {
  const int64_t kvh = a.num_kv_heads, g = a.group, d = a.head_size;
  // A block's min (and max) of every head is one run of kvh * d values at a random place (the row's block ids).
  // While a block is scored, the first 4 cache lines of the next block's two runs are asked for, and the hardware's
  // stream prefetchers fetch the rest: asking for whole runs of a page (float32 at 8 KV heads of 128) measured slower
  // than no prefetch, and no prefetch slower than this (docs/benchmarks.md).
  const int64_t kick = std::min<int64_t>(kvh * d * static_cast<int64_t>(sizeof(M)), 4 * 64);
  // Every query head's bound is kept as a vector over the head size's multiple of kW and kW heads' vectors are summed
  // by one lane_sums (a butterfly of vector additions), instead of one horizontal sum per head: 15-21% less time per
  // call (docs/benchmarks.md); a head size off the vector width adds a scalar tail per head.
  const int64_t dv = d - d % kW;
  Vec vbuf[kW];
  thread_local std::vector<float> bounds;  // [kvh * g] the block's bounds (+ kW: lane_sums writes kW at a time)
  bounds.resize(kvh * g + kW);
  for (int64_t c = begin; c < end; ++c) {
    if (c + 1 < end) {
      prefetch_bytes(static_cast<const M*>(a.key_min) + a.blocks[c + 1] * kvh * d, kick);
      prefetch_bytes(static_cast<const M*>(a.key_max) + a.blocks[c + 1] * kvh * d, kick);
    }
    const M* mn_b = static_cast<const M*>(a.key_min) + a.blocks[c] * kvh * d;
    const M* mx_b = static_cast<const M*>(a.key_max) + a.blocks[c] * kvh * d;
    // Every query head's bound of the block into bounds[h * g + u], four heads of a group at a time (they share each
    // load of the block's min and max).
    int64_t filled = 0, done = 0;
    const auto flush = [&]() {
      for (int64_t u = filled; u < kW; ++u) vbuf[u] = Vec(0.f);
      lane_sums(vbuf, bounds.data() + done);
      done += filled;
      filled = 0;
    };
    for (int64_t h = 0; h < kvh; ++h) {
      const M* mn = mn_b + h * d;
      const M* mx = mx_b + h * d;
      for (int64_t i0 = 0; i0 < g; i0 += 4) {
        const int64_t n = std::min<int64_t>(4, g - i0);
        const float* qp = a.q_pos + (h * g + i0) * d;
        const float* qn = a.q_neg + (h * g + i0) * d;
        if (filled + n > kW) flush();
        switch (n) {
          case 4: group_vectors<4>(qp, qn, mn, mx, d, dv, vbuf + filled); break;
          case 3: group_vectors<3>(qp, qn, mn, mx, d, dv, vbuf + filled); break;
          case 2: group_vectors<2>(qp, qn, mn, mx, d, dv, vbuf + filled); break;
          default: group_vectors<1>(qp, qn, mn, mx, d, dv, vbuf + filled); break;
        }
        filled += n;
      }
    }
    if (filled > 0) flush();
    for (int64_t h = 0; dv < d && h < kvh; ++h) {  // the scalar tail
      for (int64_t u = 0; u < g; ++u) {
        const float* qp = a.q_pos + (h * g + u) * d;
        const float* qn = a.q_neg + (h * g + u) * d;
        float& r = bounds[h * g + u];
        for (int64_t t = dv; t < d; ++t)
          r += qp[t] * static_cast<float>(mx_b[h * d + t]) + qn[t] * static_cast<float>(mn_b[h * d + t]);
      }
    }
    for (int64_t h = 0; h < kvh; ++h) {
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t u = 0; u < g; ++u) {
        // NaN (only from non-finite key metadata) ranks first, as in the ATen path's max over the group
        const float r = bounds[h * g + u];
        best = (std::isnan(r) || r > best) ? r : best;
        if (std::isnan(best)) break;
      }
      a.score[h * a.num_blocks + c] = best;
    }
  }
}
}  // namespace

void quest_scores(const QuestArgs& a, int64_t begin, int64_t end) {
  switch (a.dtype) {  // the metadata's dtype (the engine keeps it in the KV dtype)
    case at::kFloat: return quest_scores_as<float>(a, begin, end);
    case at::kBFloat16: return quest_scores_as<at::BFloat16>(a, begin, end);
    case at::kHalf: return quest_scores_as<at::Half>(a, begin, end);
    default: TORCH_CHECK_TYPE(false, "the Quest kernel reads float32, bfloat16 or float16 key metadata, got ", a.dtype);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace activekv::cpu_kernel
