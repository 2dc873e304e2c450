// The fast CPU attention kernel, compiled once per CPU capability (CMake sets CPU_CAPABILITY and its flags), in the
// manner of ATen's own native/cpu kernels. See activekv/cpu_kernel.h for the contract.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <activekv/cpu_kernel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace activekv::cpu_kernel {
namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;

namespace {

// dst[0:n] = float(src[0:n]) for bfloat16 / float16 blocks
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  {
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src + i, Vec::size()));
      (void)hi;
      lo.store(dst + i);
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  Vec s(0.f);
  for (; i + Vec::size() <= n; i += Vec::size()) s = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), s);
  float r = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

// y = y * alpha + p * x
inline void scale_axpy(float* y, float alpha, float p, const float* x, int64_t n) {
  int64_t i = 0;
  const Vec va(alpha), vp(p);
  for (; i + Vec::size() <= n; i += Vec::size()) {
    at::vec::fmadd(Vec::loadu(x + i), vp, Vec::loadu(y + i) * va).store(y + i);
  }
  for (; i < n; ++i) y[i] = y[i] * alpha + p * x[i];
}

template <typename T>
void attend(const AttendArgs& a) {
  const int64_t bs = a.block_size, d = a.head_size;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // Per-thread scratch: the block's K and V as float32, and one row's scores.
  thread_local std::vector<float> kf, vf, s;
  kf.resize(bs * d);
  vf.resize(bs * d);
  s.resize(bs);
  for (int64_t b = 0; b < a.num_blocks; ++b) {
    const T* kv = static_cast<const T*>(a.kv[b]);
    const float* kp;
    const float* vp;
    if constexpr (std::is_same_v<T, float>) {  // read the pool in place
      kp = kv;
      vp = kv + bs * d;
    } else {
      to_float(kv, kf.data(), bs * d);
      to_float(kv + bs * d, vf.data(), bs * d);
      kp = kf.data();
      vp = vf.data();
    }
    const int64_t key0 = a.block_pos[b] * bs;
    for (int64_t r = 0; r < a.rows; ++r) {
      const int64_t qpos = a.first_query_pos + r % a.num_q;
      const int64_t valid = std::min<int64_t>(bs, std::max<int64_t>(0, qpos - key0 + 1));  // causal: key <= query
      if (valid == 0) continue;
      const float* q = a.q + r * d;
      float mx = kNegInf;
      for (int64_t t = 0; t < valid; ++t) {
        s[t] = static_cast<float>(dot(q, kp + t * d, d) * a.scale);
        mx = std::max(mx, s[t]);
      }
      const float m_new = std::max(a.m[r], mx);
      const float alpha = std::exp(a.m[r] - m_new);  // m = -inf before the first key: alpha = 0
      float* acc = a.acc + r * d;
      float l = a.l[r] * alpha;
      // exp over the block's scores, vectorised where the block allows
      int64_t t = 0;
      const Vec vm(m_new);
      for (; t + Vec::size() <= valid; t += Vec::size()) (Vec::loadu(s.data() + t) - vm).exp().store(s.data() + t);
      for (; t < valid; ++t) s[t] = std::exp(s[t] - m_new);
      for (t = 0; t < valid; ++t) {
        l += s[t];
        scale_axpy(acc, t == 0 ? alpha : 1.f, s[t], vp + t * d, d);
      }
      a.m[r] = m_new;
      a.l[r] = l;
    }
  }
}

}  // namespace

void attend_blocks(const AttendArgs& args) {
  switch (args.dtype) {
    case at::kFloat: return attend<float>(args);
    case at::kBFloat16: return attend<at::BFloat16>(args);
    case at::kHalf: return attend<at::Half>(args);
    default: TORCH_CHECK_TYPE(false, "the CPU kernel supports float32, bfloat16 and float16 KV, got ", args.dtype);
  }
}

void quest_scores(const QuestArgs& a, int64_t begin, int64_t end) {
  const int64_t kvh = a.num_kv_heads, g = a.group, d = a.head_size;
  for (int64_t c = begin; c < end; ++c) {
    const float* mn_b = a.key_min + a.blocks[c] * kvh * d;
    const float* mx_b = a.key_max + a.blocks[c] * kvh * d;
    for (int64_t h = 0; h < kvh; ++h) {
      const float* mn = mn_b + h * d;
      const float* mx = mx_b + h * d;
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < g; ++i) {
        const float* qp = a.q_pos + (h * g + i) * d;
        const float* qn = a.q_neg + (h * g + i) * d;
        int64_t j = 0;
        Vec s(0.f);
        for (; j + Vec::size() <= d; j += Vec::size()) {
          s = at::vec::fmadd(Vec::loadu(qp + j), Vec::loadu(mx + j), s);
          s = at::vec::fmadd(Vec::loadu(qn + j), Vec::loadu(mn + j), s);
        }
        float r = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s);
        for (; j < d; ++j) r += qp[j] * mx[j] + qn[j] * mn[j];
        // NaN (only from non-finite key metadata) ranks first, as in the ATen path's max over the group
        best = (std::isnan(r) || r > best) ? r : best;
        if (std::isnan(best)) break;
      }
      a.score[h * a.num_blocks + c] = best;
    }
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace activekv::cpu_kernel
