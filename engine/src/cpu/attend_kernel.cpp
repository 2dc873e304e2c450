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

// dst[0:n] = float(src[0:n]) for bfloat16 / float16 blocks: a full vector of 16-bit values (two float vectors) at a
// time, then half vectors, then scalars.
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  using VecT = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    static_assert(VecT::size() == 2 * W, "a 16-bit vector holds two float vectors");
    auto [lo, hi] = at::vec::convert_to_float<T>(VecT::loadu(src + i));
    lo.store(dst + i);
    hi.store(dst + i + W);
  }
  for (; i + W <= n; i += W) {
    auto [lo, hi] = at::vec::convert_to_float<T>(VecT::loadu(src + i, W));
    (void)hi;
    lo.store(dst + i);
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float reduce_add(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// One block for RB query rows (rows r0 .. r0 + RB - 1 of the args): the rows share every load of K and V. Scores are
// q . k per key (vectorised fused multiply-adds over the head, reduced once per key), the online-softmax state of each
// row is rescaled once per block, and the accumulator of each row is read and written once per block: the head is
// walked one vector at a time with the RB rows' accumulators in registers while the keys stream past.
template <int RB>
void block_rows(const AttendArgs& a, int64_t r0, const float* kp, const float* vp, int64_t key0, float* s) {
  const int64_t bs = a.block_size, d = a.head_size;
  constexpr int64_t W = Vec::size();
  const int64_t dv = d - d % W;  // vectorised part of the head
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const float scale = static_cast<float>(a.scale);
  int64_t valid[RB];
  int64_t vmax = 0, vmin = bs;
  for (int i = 0; i < RB; ++i) {
    const int64_t qpos = a.first_query_pos + (r0 + i) % a.num_q;
    valid[i] = std::min<int64_t>(bs, std::max<int64_t>(0, qpos - key0 + 1));  // causal: key <= query
    vmax = std::max(vmax, valid[i]);
    vmin = std::min(vmin, valid[i]);
  }
  if (vmax == 0) return;
  const float* q[RB];
  for (int i = 0; i < RB; ++i) q[i] = a.q + (r0 + i) * d;
  // Scores s[i * bs + t] for t < vmax (keys past a row's causal limit are computed and then ignored).
  for (int64_t t = 0; t < vmax; ++t) {
    const float* k = kp + t * d;
    Vec acc[RB];
    for (int i = 0; i < RB; ++i) acc[i] = Vec(0.f);
    for (int64_t j = 0; j < dv; j += W) {
      const Vec kv = Vec::loadu(k + j);
      for (int i = 0; i < RB; ++i) acc[i] = at::vec::fmadd(Vec::loadu(q[i] + j), kv, acc[i]);
    }
    for (int i = 0; i < RB; ++i) {
      float r = reduce_add(acc[i]);
      for (int64_t j = dv; j < d; ++j) r += q[i][j] * k[j];
      s[i * bs + t] = r * scale;
    }
  }
  // Online softmax per row: new running max, rescale factor, probabilities in place of the scores.
  float alpha[RB];
  for (int i = 0; i < RB; ++i) {
    const int64_t r = r0 + i, n = valid[i];
    float* si = s + i * bs;
    if (n == 0) {
      alpha[i] = 1.f;
      continue;
    }
    float mx = kNegInf;
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, si[t]);
    const float m_new = std::max(a.m[r], mx);
    alpha[i] = std::exp(a.m[r] - m_new);  // m = -inf before the first key: alpha = 0
    int64_t t = 0;
    const Vec vm(m_new);
    for (; t + W <= n; t += W) (Vec::loadu(si + t) - vm).exp().store(si + t);
    for (; t < n; ++t) si[t] = std::exp(si[t] - m_new);
    float l = 0.f;
    for (t = 0; t < n; ++t) l += si[t];
    a.l[r] = a.l[r] * alpha[i] + l;
    a.m[r] = m_new;
  }
  // acc = acc * alpha + sum_t p_t v_t, one vector of the head at a time; a row reads only its valid keys' V.
  float* acc[RB];
  for (int i = 0; i < RB; ++i) acc[i] = a.acc + (r0 + i) * d;
  for (int64_t j = 0; j < dv; j += W) {
    Vec o[RB];
    for (int i = 0; i < RB; ++i) o[i] = Vec::loadu(acc[i] + j) * Vec(alpha[i]);
    if (vmin == vmax) {
      for (int64_t t = 0; t < vmax; ++t) {
        const Vec v = Vec::loadu(vp + t * d + j);
        for (int i = 0; i < RB; ++i) o[i] = at::vec::fmadd(Vec(s[i * bs + t]), v, o[i]);
      }
    } else {
      for (int64_t t = 0; t < vmax; ++t) {
        const Vec v = Vec::loadu(vp + t * d + j);
        for (int i = 0; i < RB; ++i)
          if (t < valid[i]) o[i] = at::vec::fmadd(Vec(s[i * bs + t]), v, o[i]);
      }
    }
    for (int i = 0; i < RB; ++i) o[i].store(acc[i] + j);
  }
  for (int64_t j = dv; j < d; ++j) {
    for (int i = 0; i < RB; ++i) {
      float o = acc[i][j] * alpha[i];
      for (int64_t t = 0; t < valid[i]; ++t) o += s[i * bs + t] * vp[t * d + j];
      acc[i][j] = o;
    }
  }
}

constexpr int kRowBlock = 4;  // query rows sharing each pass over a block (a GQA group of 4 in one pass)

template <typename T>
void attend(const AttendArgs& a) {
  const int64_t bs = a.block_size, d = a.head_size;
  // Per-thread scratch: the block's K and V as float32 (16-bit dtypes), and the scores of kRowBlock rows.
  thread_local std::vector<float> kf, vf, s;
  if constexpr (!std::is_same_v<T, float>) {
    kf.resize(bs * d);
    vf.resize(bs * d);
  }
  s.resize(kRowBlock * bs);
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
    int64_t r0 = 0;
    for (; r0 + kRowBlock <= a.rows; r0 += kRowBlock) block_rows<kRowBlock>(a, r0, kp, vp, key0, s.data());
    switch (a.rows - r0) {
      case 3: block_rows<3>(a, r0, kp, vp, key0, s.data()); break;
      case 2: block_rows<2>(a, r0, kp, vp, key0, s.data()); break;
      case 1: block_rows<1>(a, r0, kp, vp, key0, s.data()); break;
      default: break;
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
