#pragma once
// Private to engine/src/cpu/: the vector primitives the CPU kernel's files share (attend_avx.cpp, attend_amx.cpp,
// quest_scores.cpp), each file compiled once per CPU capability (CMake sets CPU_CAPABILITY and its flags), in the
// manner of ATen's own native/cpu kernels: loads that widen bfloat16 / float16, lane sums, the q.k scorers (float32
// fused multiply-adds and AVX512-BF16 dot products), prefetch, the causal limit and the online-softmax merge of a
// chunk's scores. Included by those files only; activekv/cpu_kernel.h is the kernel's contract.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <activekv/cpu_kernel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace activekv::cpu_kernel {
namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;
constexpr int kW = Vec::size();  // keys scored together, and floats per vector
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if defined(CPU_CAPABILITY_AVX512)
// The bfloat16 AMX path (attend_amx.cpp). Whether it may run (asked once per process): the processor has AMX-TILE
// and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22) and AVX512-BF16, Linux grants this process the tile data state
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, as oneDNN asks; refused by kernels before 5.16), and the
// environment does not set ACTIVEKV_CPU_AMX=0.
bool amx_ready();
// Whether a call runs on AMX: bfloat16 KV, a bfloat16 query, head size a multiple of 32, block size of 16s, amx_ready().
bool use_amx(const AttendArgs& a);
// attend_blocks on AMX tiles (see attend_amx.cpp).
void attend_amx(const AttendArgs& a);
#endif

// Internal linkage in each including file, as when these lived in one file: every capability's objects keep their own
// copies, inlined where the compiler sees fit.
namespace {

// kW values of T at p as one float vector (bfloat16 / float16 widened exactly).
template <typename T>
inline Vec load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bfloat16: the high half
    } else {
      return _mm512_cvtph_ps(h);
    }
#else
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, kW));
    (void)hi;
    return lo;
#endif
  }
}

inline float reduce_add(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// out[t] = sum of the lanes of v[t] for the kW vectors v[0..kW). With AVX-512: a butterfly over the 16 vectors (15
// additions of whole vectors and 30 shuffles for 16 sums) instead of one horizontal reduction per vector (4 dependent
// shuffle-add pairs each). The summation order is fixed either way.
#if defined(CPU_CAPABILITY_AVX512)
// Always inlined: called out of line (as GCC chose once chunk_rows grew), its 16 accumulators go through memory and a
// decode step at block 16 took 15-25% longer.
__attribute__((always_inline)) inline void lane_sums(const __m512* v, float* out) {
  // Inputs are taken in the order kPerm (an involution), so that lane t of the result is the sum of v[t].
  constexpr int kPerm[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
  __m512 b[8], c[4], e[2];
  for (int k = 0; k < 8; ++k) {  // 256-bit halves: b[k] = [8 partials of input k | 8 partials of input k + 8]
    const __m512 x = v[kPerm[k]], y = v[kPerm[k + 8]];
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int k = 0; k < 4; ++k)  // 128-bit quarters: 4 partials per input
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[k], b[k + 4], 0x88), _mm512_shuffle_f32x4(b[k], b[k + 4], 0xDD));
  for (int k = 0; k < 2; ++k)  // pairs within each quarter: 2 partials per input
    e[k] = _mm512_add_ps(_mm512_shuffle_ps(c[k], c[k + 2], 0x44), _mm512_shuffle_ps(c[k], c[k + 2], 0xEE));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD)));
}

__attribute__((always_inline)) inline void lane_sums(const Vec* v, float* out) {
  static_assert(kW == 16, "AVX-512 float vectors hold 16 lanes");
  __m512 m[16];
  for (int t = 0; t < 16; ++t) m[t] = v[t];
  lane_sums(m, out);
}
#else
__attribute__((always_inline)) inline void lane_sums(const Vec* v, float* out) {
  for (int t = 0; t < kW; ++t) out[t] = reduce_add(v[t]);
}
#endif

// One pass of a group's scores: the kW accumulators of KP = kW / RB keys for RB query rows (acc[i * KP + t]), each
// summed across its lanes by one lane_sums, scaled and stored at out[i * ld + p * KP + t]. One row's kW scores
// (RB = 1) are contiguous and scaled as one vector. The float32 and the AVX512-BF16 scorers both end with this.
template <int RB, typename V>
inline void store_scores(const V* acc, int p, float scale, float* out, int64_t ld) {
  constexpr int KP = kW / RB;
  if constexpr (RB == 1) {
    lane_sums(acc, out);
    (Vec::loadu(out) * Vec(scale)).store(out);
  } else {
    alignas(64) float sums[kW];
    lane_sums(acc, sums);
    for (int i = 0; i < RB; ++i)
      for (int t = 0; t < KP; ++t) out[i * ld + p * KP + t] = sums[i * KP + t] * scale;
  }
}

// Scores of kW consecutive keys, all of them visible, for RB consecutive query rows at once (RB divides kW):
// out[i * ld + t] = scale * (q_i . k_t). Each of a key's vectors of K is loaded once for the RB rows, where
// score_keys loads it once per row; kW / RB keys per pass, whose RB * kW / RB dot products accumulate in kW
// registers and are summed by one lane_sums. Per dot product the same fused multiply-adds in the same order and the
// same lane sum as score_keys (bit-identical to it). head_size a multiple of kW.
template <typename T, int RB>
inline void score_keys_rows(const float* q, const T* k, int64_t d, float scale, float* out, int64_t ld) {
  static_assert(kW % RB == 0, "the rows must divide the keys scored together");
  constexpr int KP = kW / RB;
  for (int p = 0; p < RB; ++p) {
    Vec acc[RB * KP];
    for (int x = 0; x < RB * KP; ++x) acc[x] = Vec(0.f);
    for (int64_t j = 0; j < d; j += kW) {
      Vec qv[RB];
      for (int i = 0; i < RB; ++i) qv[i] = Vec::loadu(q + i * d + j);
      for (int t = 0; t < KP; ++t) {
        const Vec kv = load_float(k + (p * KP + t) * d + j);
        for (int i = 0; i < RB; ++i) acc[i * KP + t] = at::vec::fmadd(qv[i], kv, acc[i * KP + t]);
      }
    }
    store_scores<RB>(acc, p, scale, out, ld);
  }
}

// Scores of n <= kW consecutive keys (rows of k, stride d) for one query row: out[t] = scale * (q . k_t), t < n: the
// groups score_group does not take (fewer than kW keys, or a head size off the vector width). The row's vector of q
// is loaded once per kW keys; the dot products accumulate in kW registers, summed by lane_sums, the same per dot
// product as score_keys_rows; a head size that is not a multiple of kW ends with a scalar tail.
template <typename T>
inline void score_keys(const float* q, const T* k, int64_t d, int64_t n, float scale, float* out) {
  const int64_t dv = d - d % kW;
  Vec acc[kW];
  for (int t = 0; t < kW; ++t) acc[t] = Vec(0.f);
  for (int64_t j = 0; j < dv; j += kW) {
    const Vec qv = Vec::loadu(q + j);
    for (int64_t t = 0; t < n; ++t) acc[t] = at::vec::fmadd(qv, load_float(k + t * d + j), acc[t]);
  }
  float sums[kW];
  lane_sums(acc, sums);
  for (int64_t t = 0; t < n; ++t) {
    float r = sums[t];
    for (int64_t j = dv; j < d; ++j) r += q[j] * static_cast<float>(k[t * d + j]);
    out[t] = r * scale;
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// 32 bfloat16 values at p as vdpbf16ps' pairs; with half, 16 values and the upper half zero.
__attribute__((target("avx512bf16"))) inline __m512bh bf16_piece(const at::BFloat16* p, bool half) {
  return half ? (__m512bh)_mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
              : (__m512bh)_mm512_loadu_si512(p);
}

// bfloat16 K with AVX512-BF16 (`vdpbf16ps`: per float lane, two bfloat16 products added to the accumulator): the
// query rows q_bf16 are the float32 rows rounded back to bfloat16, exact because they were widened from the model's
// bfloat16; K is read as stored, with no widening pass. Per key and row, head_size / 32 instructions instead of
// head_size / 16 widenings and fused multiply-adds. Used when the processor has the extension (has_bf16_dot), else
// score_keys. Same result as score_keys up to float32 rounding (each instruction rounds its two products' sum).
// Scores of 16 consecutive keys, all visible, for RB consecutive query rows (row stride head_size) at once, as
// score_keys_rows does for float32: out[i * ld + t] = scale * (q_i . k_t); each of a key's 32-value pieces of K is
// loaded once for the RB rows, 16 / RB keys per pass, their 16 dot products summed by one lane_sums. Per dot product
// the same instructions in the same order for every RB (RB = 1: one row, its 16 scores scaled as one vector), so
// the rows' scores do not depend on how many rows are scored together. head_size a multiple of 16.
template <int RB>
__attribute__((target("avx512bf16"))) void score_keys_bf16_rows(const at::BFloat16* q_bf16, const at::BFloat16* k,
                                                                 int64_t d, float scale, float* out, int64_t ld) {
  static_assert(16 % RB == 0, "the rows must divide the keys scored together");
  constexpr int KP = 16 / RB;
  for (int p = 0; p < RB; ++p) {
    const at::BFloat16* kp = k + p * KP * d;
    __m512 acc[16];
    for (int x = 0; x < 16; ++x) acc[x] = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; j += 32) {
      const bool half = j + 32 > d;  // head sizes 80, 112, ...: a last piece of 16 values
      __m512bh qv[RB];
      for (int i = 0; i < RB; ++i) qv[i] = bf16_piece(q_bf16 + i * d + j, half);
      for (int t = 0; t < KP; ++t) {
        const __m512bh kv = bf16_piece(kp + t * d + j, half);
        for (int i = 0; i < RB; ++i) acc[i * KP + t] = _mm512_dpbf16_ps(acc[i * KP + t], qv[i], kv);
      }
    }
    store_scores<RB>(acc, p, scale, out, ld);
  }
}

// Whether the processor has AVX512-BF16 (asked once; __builtin_cpu_init first, as a static initializer may run before
// libgcc's own).
bool has_bf16_dot() {
  static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avx512bf16") != 0);
  return yes;
}
#endif

// Scores of kW consecutive keys that the RB consecutive query rows r0 .. r0 + RB - 1 all see, into out[i * ld + t]:
// by AVX512-BF16 dot products against q_bf16 where it is given (bfloat16 K), else against the float32 rows (head size
// a multiple of kW). The one scorer of whole groups, for the rows together and for each row alone.
template <typename T, int RB>
inline void score_group(const AttendArgs& a, const at::BFloat16* q_bf16, int64_t r0, const T* k, float scale,
                        float* out, int64_t ld) {
  const int64_t d = a.head_size;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (q_bf16 != nullptr) return score_keys_bf16_rows<RB>(q_bf16 + r0 * d, k, d, scale, out, ld);
  }
#endif
  score_keys_rows<T, RB>(a.q + r0 * d, k, d, scale, out, ld);
}

// Ask for the cache lines of [p, p + bytes) ahead of use. A block's K and V of one head are a few KiB (4 KiB at
// block 16 and head size 32 in float32), read one after another from slots spread over the pool: the hardware's stream
// prefetchers stop at each 4 KiB page, so without this every block starts with demand misses.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// Start the hardware's stream prefetchers on a block's K and V (each a run of `half` bytes, K first): ask for the
// first `lines` cache lines of each, and the prefetchers, seeing a stream begin, fetch the rest of its page.
inline void kick_kv(const void* kv, int64_t half, int lines) {
  const char* c = static_cast<const char*>(kv);
  for (int i = 0; i < lines; ++i) {
    __builtin_prefetch(c + 64 * i, 0, 3);
    __builtin_prefetch(c + half + 64 * i, 0, 3);
  }
}

// While block c's K is scored, ask for the next block: a K of a page or more (head size 128 in float32) has its first
// 2 lines and V's asked for, the hardware prefetchers fetching the rest of each page; a smaller K (the e2e model's
// head size 32) is asked for whole, its V left to the hardware. Each measured best for its size (docs/benchmarks.md;
// asking for a whole K of a page or more kept the fill buffers full and stalled).
inline void ask_next_block(const AttendArgs& a, int64_t c, int64_t k_bytes) {
  if (c + 1 >= a.num_blocks) return;
  if (k_bytes >= 4096) {
    kick_kv(a.kv[c + 1], k_bytes, 2);
  } else {
    prefetch_bytes(a.kv[c + 1], k_bytes);
  }
}

// v, held in a register: the compiler may not fold its load into each of the RB fused multiply-adds that read it
// (as it otherwise does, loading V once per query row: on processors that load one 512-bit vector per cycle, such as
// AMD Zen 4, P x V then waits on the loads, not the multiply-adds).
inline Vec in_register(Vec v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 x = v;
  asm("" : "+v"(x));
  return x;
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 x = v;
  asm("" : "+x"(x));
  return x;
#else
  return v;
#endif
}

// Causal limit of query row r (of the request row): the keys before its position and its own.
inline int64_t keys_seen(const AttendArgs& a, int64_t r) { return a.first_query_pos + r % a.num_q + 1; }

// Of the block starting at key0, the keys a row that has seen `seen` keys may attend: 0 .. bs.
inline int64_t visible_in_block(int64_t seen, int64_t key0, int64_t bs) {
  return std::min<int64_t>(bs, std::max<int64_t>(0, seen - key0));
}

// valid[i * cb + c] = the keys row r0 + i may attend in block c0 + c of the args, for RB rows (one division per row,
// not per block); returns their sum (0: the rows see none of these blocks).
template <int RB>
inline int64_t fill_valid(const AttendArgs& a, int64_t r0, int64_t c0, int64_t cb, int64_t* valid) {
  const int64_t bs = a.block_size;
  int64_t any = 0;
  for (int i = 0; i < RB; ++i) {
    const int64_t seen = keys_seen(a, r0 + i);
    for (int64_t c = 0; c < cb; ++c) any += valid[i * cb + c] = visible_in_block(seen, a.block_pos[c0 + c] * bs, bs);
  }
  return any;
}

// Online softmax per row r0 + i over a chunk's scores s [RB, nk] (row stride nk), in place: the new running max
// (a.m), the running sum (a.l), the accumulator's rescale alpha[i] and the probabilities in place of the scores. With
// pb (the AMX path; nk a multiple of 16), each probability is also rounded to bfloat16 into pb [RB, ldp] (zeros from
// nk to ldp, and for a row that sees no key of the chunk), and the running sum adds the rounded values, the ones its
// P x V multiplies.
// With end (pb null), row i's scores from end[i] on are all -inf (end[i] a multiple of kW, or nk) and are neither
// read nor written: the same running max and sum as over all nk (each skipped key would add exp(-inf) = 0).
template <int RB>
void merge_rows(const AttendArgs& a, int64_t r0, float* s, int64_t nk, float* alpha, at::BFloat16* pb, int64_t ldp,
                const int64_t* end = nullptr) {
  for (int i = 0; i < RB; ++i) {
    const int64_t r = r0 + i;
    float* si = s + i * nk;
    const int64_t ne = end != nullptr ? end[i] : nk;
    const int64_t nkv = std::min(ne, nk - nk % kW);
    // Four running maxima, so that the loads do not wait on one chain of maximum operations (the max is exact in
    // any order).
    Vec vmx(kNegInf), vm1(kNegInf), vm2(kNegInf), vm3(kNegInf);
    int64_t t4 = 0;
    for (; t4 + 4 * kW <= nkv; t4 += 4 * kW) {
      vmx = at::vec::maximum(vmx, Vec::loadu(si + t4));
      vm1 = at::vec::maximum(vm1, Vec::loadu(si + t4 + kW));
      vm2 = at::vec::maximum(vm2, Vec::loadu(si + t4 + 2 * kW));
      vm3 = at::vec::maximum(vm3, Vec::loadu(si + t4 + 3 * kW));
    }
    for (; t4 < nkv; t4 += kW) vmx = at::vec::maximum(vmx, Vec::loadu(si + t4));
    vmx = at::vec::maximum(at::vec::maximum(vmx, vm1), at::vec::maximum(vm2, vm3));
    float mx = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmx);
    for (int64_t t = nkv; t < ne; ++t) mx = std::isnan(si[t]) ? si[t] : std::max(mx, si[t]);
    if (std::isnan(mx) || std::isnan(a.m[r])) {
      // A NaN score (a NaN in the query or a visible key), now or in an earlier chunk: the row's state and so its
      // output become NaN, as with the ATen path (exp_u20 below clamps its argument and would hide a NaN).
      const float nan = std::numeric_limits<float>::quiet_NaN();
      alpha[i] = nan;
      std::fill(si, si + ne, nan);
      if (pb != nullptr) std::fill(pb + i * ldp, pb + (i + 1) * ldp, at::BFloat16(nan));
      a.l[r] = a.m[r] = nan;
      continue;
    }
    if (mx == kNegInf) {  // no key of the chunk is visible to this row
      alpha[i] = 1.f;
      if (pb != nullptr) std::fill(pb + i * ldp, pb + (i + 1) * ldp, at::BFloat16(0.f));
      continue;
    }
    const float m_new = std::max(a.m[r], mx);
    alpha[i] = std::exp(a.m[r] - m_new);  // m = -inf before the first key: alpha = 0
    const Vec vm(m_new);
    Vec sum(0.f);
    float l = 0.f;
    if (pb == nullptr) {
      for (int64_t t = 0; t < nkv; t += kW) {
        const Vec p = (Vec::loadu(si + t) - vm).exp_u20();  // exp(-inf) = 0 for the keys past the limit
        p.store(si + t);
        sum = sum + p;
      }
      l = reduce_add(sum);
      for (int64_t t = nkv; t < ne; ++t) l += si[t] = std::exp(si[t] - m_new);
    } else {
      at::BFloat16* pi = pb + i * ldp;
      for (int64_t t = 0; t < ldp; t += 2 * kW) {  // 32 probabilities per conversion; past nk, zeros
        const Vec lo = t < nk ? (Vec::loadu(si + t) - vm).exp_u20() : Vec(0.f);
        const Vec hi = t + kW < nk ? (Vec::loadu(si + t + kW) - vm).exp_u20() : Vec(0.f);
        const auto rounded = at::vec::convert_from_float<at::BFloat16>(lo, hi);
        rounded.store(pi + t);
        auto [rlo, rhi] = at::vec::convert_to_float<at::BFloat16>(rounded);
        sum = sum + rlo + rhi;
      }
      l = reduce_add(sum);
    }
    a.l[r] = a.l[r] * alpha[i] + l;
    a.m[r] = m_new;
  }
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace activekv::cpu_kernel
